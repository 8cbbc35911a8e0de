//! Which instructions compute the integer block dots ([`Flavour`]), and
//! whether this CPU has them.

use std::sync::OnceLock;

use crate::dispatch::Backend;

/// How a backend computes the integer block dots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Flavour {
    Portable,
    /// `maddubs` + `madd`, AVX2, FMA and F16C.
    Avx2,
    /// `vpdpbusd` on 256-bit vectors (AVX-512 VNNI and VL; BW's byte masks
    /// for Q5 blocks' fifth bits), plus AVX2 and FMA.
    Vnni,
}

impl Flavour {
    /// The flavour of a backend: [`Backend::Avx2Fma`] uses VNNI when the CPU has it.
    pub(super) fn of(be: Backend) -> Flavour {
        match be {
            Backend::Portable => Flavour::Portable,
            Backend::Avx2Fma => {
                assert!(
                    has(Flavour::Avx2),
                    "the Avx2Fma backend needs a CPU with AVX2 and FMA"
                );
                if has(Flavour::Vnni) {
                    Flavour::Vnni
                } else {
                    Flavour::Avx2
                }
            }
        }
    }
}

/// Whether this CPU can run `f` (detected once).
pub(super) fn has(f: Flavour) -> bool {
    static CPU: OnceLock<(bool, bool)> = OnceLock::new();
    let &(avx2, vnni) = CPU.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            let vnni = avx2
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bw");
            (avx2, vnni)
        }
        #[cfg(not(target_arch = "x86_64"))]
        (false, false)
    });
    match f {
        Flavour::Portable => true,
        Flavour::Avx2 => avx2,
        Flavour::Vnni => vnni,
    }
}
