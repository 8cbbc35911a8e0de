//! The format a fresh load serves its weights in ([`WeightFormat`]): as the
//! checkpoint stores them, or every matrix converted to one format.

use crate::qtype::QType;
use crate::weights::DType;
use crate::ModelConfig;

/// How a fresh load stores the model's matrices (projections, token
/// embeddings, LM head). Norms and other 1-D tensors are f32 whatever the
/// format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// As the checkpoint stores them: a GGUF file's block formats, a
    /// safetensors checkpoint's F16/BF16 (F32 stays f32).
    #[default]
    AsStored,
    /// Every matrix converted to `DType` (see [`WeightFormat::planned`] for
    /// the LM head and for rows that are not whole blocks).
    Convert(DType),
}

/// The names [`WeightFormat`] parses, for help texts.
pub const WEIGHT_FORMAT_NAMES: &str =
    "auto, f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k";

impl std::str::FromStr for WeightFormat {
    type Err = String;

    /// `auto` (as stored), `f32`, or a block format's lower-case name
    /// ([`DType::name`]).
    fn from_str(s: &str) -> Result<WeightFormat, String> {
        if s == "auto" {
            return Ok(WeightFormat::AsStored);
        }
        let all = QType::INT
            .into_iter()
            .chain([QType::F16, QType::BF16])
            .map(DType::Quant);
        std::iter::once(DType::F32)
            .chain(all)
            .find(|d| d.name() == s.to_ascii_lowercase())
            .map(WeightFormat::Convert)
            .ok_or_else(|| format!("unknown weight format `{s}` (known: {WEIGHT_FORMAT_NAMES})"))
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightFormat::AsStored => f.write_str("auto"),
            WeightFormat::Convert(d) => f.write_str(d.name()),
        }
    }
}

impl WeightFormat {
    /// The block format a matrix with rows of `cols` values is converted
    /// to (`None`: f32), as llama.cpp's quantiser chooses for a model
    /// quantised to one type: the output matrix (the LM head, or the token
    /// embeddings when they are tied to it) is Q6_K (Q8_0 when its rows are
    /// not whole 256-value super-blocks) unless the format is Q8_0, F16 or
    /// BF16; a K format falls back, for rows that are not whole
    /// super-blocks, to Q5_0 (Q4_K), Q5_1 (Q5_K) or Q8_0 (Q6_K); and rows
    /// that are not whole 32-value blocks stay f32.
    ///
    /// Only for [`WeightFormat::Convert`]; `AsStored` has no answer of its
    /// own (the checkpoint's types decide).
    pub fn planned(self, output: bool, cols: usize) -> Option<QType> {
        let WeightFormat::Convert(DType::Quant(q)) = self else {
            return None;
        };
        let keeps_output = matches!(q, QType::Q8_0 | QType::F16 | QType::BF16);
        let q = if output && !keeps_output {
            QType::Q6_K
        } else {
            q
        };
        let q = if cols.is_multiple_of(q.block_values()) {
            q
        } else {
            match q {
                QType::Q4_K => QType::Q5_0,
                QType::Q5_K => QType::Q5_1,
                QType::Q6_K => QType::Q8_0,
                other => other,
            }
        };
        cols.is_multiple_of(q.block_values()).then_some(q)
    }
}

/// The plan's block formats for a model of `cfg` converted to `format`
/// (see [`WeightFormat::planned`]; the output matrix is the LM head, or the
/// token embeddings when they are tied to it).
pub(super) fn converted(
    format: WeightFormat,
    cfg: &ModelConfig,
) -> impl Fn(&str, &str, usize) -> Option<QType> {
    let tied = cfg.tie_word_embeddings;
    move |gguf, _, cols| {
        let output = gguf == "output.weight" || (tied && gguf == "token_embd.weight");
        format.planned(output, cols)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for name in WEIGHT_FORMAT_NAMES.split(", ") {
            let f: WeightFormat = name.parse().unwrap();
            assert_eq!(f.to_string(), name);
        }
        assert!("q3_k".parse::<WeightFormat>().is_err());
    }

    #[test]
    fn the_output_matrix_and_odd_rows_follow_llama_cpp() {
        let q4_1 = WeightFormat::Convert(DType::Quant(QType::Q4_1));
        let q4_k = WeightFormat::Convert(DType::Quant(QType::Q4_K));
        let f16 = WeightFormat::Convert(DType::Quant(QType::F16));
        assert_eq!(q4_1.planned(false, 576), Some(QType::Q4_1));
        assert_eq!(q4_1.planned(true, 576), Some(QType::Q8_0));
        assert_eq!(q4_1.planned(true, 512), Some(QType::Q6_K));
        assert_eq!(q4_k.planned(false, 576), Some(QType::Q5_0));
        assert_eq!(q4_k.planned(false, 1536), Some(QType::Q4_K));
        assert_eq!(f16.planned(true, 576), Some(QType::F16));
        assert_eq!(q4_1.planned(false, 70), None);
        assert_eq!(WeightFormat::Convert(DType::F32).planned(false, 64), None);
    }
}
