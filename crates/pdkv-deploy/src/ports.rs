//! The ports of a deployment: the proxy's, then each server's HTTP port and
//! each prefill server's KV control port; 0 where a child binds a free one.

use crate::error::DeployError;

/// What the operator asked for: how many servers of each kind, and the
/// first port of each run (`None`: each server binds a free one).
#[derive(Clone, Debug)]
pub struct PortPlan {
    /// The proxy's port; 0 picks a free one.
    pub proxy: u16,
    pub prefill: u16,
    pub decode: u16,
    pub prefill_port: Option<u16>,
    pub decode_port: Option<u16>,
    pub kv_port: Option<u16>,
}

/// The ports of a deployment, checked: no port used twice.
#[derive(Clone, Debug)]
pub struct Ports {
    pub(crate) proxy: u16,
    pub(crate) prefill: Vec<u16>,
    pub(crate) decode: Vec<u16>,
    pub(crate) kv: Vec<u16>,
}

/// `n` ports from `first` on, or `n` zeros (each server binds a free one).
fn run(first: Option<u16>, n: u16, what: &'static str) -> Result<Vec<u16>, DeployError> {
    match first {
        Some(p) => (0..n)
            .map(|i| {
                p.checked_add(i)
                    .ok_or(DeployError::PortsPastEnd { what, first: p })
            })
            .collect(),
        None => Ok(vec![0; usize::from(n)]),
    }
}

impl Ports {
    pub fn choose(plan: &PortPlan) -> Result<Ports, DeployError> {
        let p = Ports {
            proxy: plan.proxy,
            prefill: run(plan.prefill_port, plan.prefill, "prefill")?,
            decode: run(plan.decode_port, plan.decode, "decode")?,
            kv: run(plan.kv_port, plan.prefill, "KV")?,
        };
        let mut all: Vec<u16> = [p.proxy]
            .into_iter()
            .chain(p.prefill.iter().copied())
            .chain(p.decode.iter().copied())
            .chain(p.kv.iter().copied())
            .filter(|&port| port != 0)
            .collect();
        all.sort_unstable();
        if let Some(w) = all.windows(2).find(|w| w[0] == w[1]) {
            return Err(DeployError::PortTwice {
                port: w[0],
                proxy: p.proxy,
                prefill: p.prefill,
                decode: p.decode,
                kv: p.kv,
            });
        }
        Ok(p)
    }

    /// Fails naming the first chosen port (not 0) that another process
    /// holds on loopback, and the flag that chooses another: checked before
    /// any engine loads a model.
    pub fn check_free(&self) -> Result<(), DeployError> {
        let named = std::iter::once((self.proxy, "--port"))
            .chain(self.prefill.iter().map(|&q| (q, "--prefill-port")))
            .chain(self.decode.iter().map(|&q| (q, "--decode-port")))
            .chain(self.kv.iter().map(|&q| (q, "--kv-port")));
        for (port, flag) in named.filter(|&(port, _)| port != 0) {
            std::net::TcpListener::bind((crate::HOST, port))
                .map_err(|source| DeployError::PortTaken { port, flag, source })?;
        }
        Ok(())
    }

    /// `prefill` and `decode` servers and the proxy, each on a port of its
    /// choosing.
    pub fn any(prefill: u16, decode: u16) -> Ports {
        Ports {
            proxy: 0,
            prefill: vec![0; usize::from(prefill)],
            decode: vec![0; usize::from(decode)],
            kv: vec![0; usize::from(prefill)],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(prefill_port: Option<u16>, decode_port: Option<u16>) -> PortPlan {
        PortPlan {
            proxy: 8000,
            prefill: 2,
            decode: 2,
            prefill_port,
            decode_port,
            kv_port: None,
        }
    }

    #[test]
    fn runs_follow_their_first_port_and_never_overlap() {
        let p = Ports::choose(&plan(Some(9000), Some(9100))).unwrap();
        assert_eq!(
            (p.prefill, p.decode, p.kv),
            (vec![9000, 9001], vec![9100, 9101], vec![0, 0])
        );
        assert!(matches!(
            Ports::choose(&plan(Some(9000), Some(9001))),
            Err(DeployError::PortTwice { port: 9001, .. })
        ));
        assert!(matches!(
            Ports::choose(&plan(Some(65535), None)),
            Err(DeployError::PortsPastEnd {
                what: "prefill",
                first: 65535
            })
        ));
    }
}
