//! The child process guard: one `pdkv` child with its stderr read line by
//! line (forwarded, written to a file, or only kept), its URL learned from
//! its `listening on` line, and the ways to notice its exit and to stop a
//! set of children (SIGTERM, a bounded wait, SIGKILL; all reaped).

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::DeployError;
use crate::wiring::HOST;

/// How long stopped children get to exit before SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(15);
/// Log lines of a child kept for an error report.
const TAIL_LINES: usize = 30;
/// Interval of the exit checks while children stop.
const STOP_POLL: Duration = Duration::from_millis(50);

/// Where children's log lines go.
#[derive(Clone, Debug)]
pub enum LogSink {
    /// Our stderr, each line prefixed with the child's name.
    Stderr,
    /// A log file per child in this directory (`prefill.log`, ...).
    Dir(PathBuf),
    /// Nowhere (the last lines are still kept for an error report).
    Discard,
}

/// Where children's log lines go, and the name that starts this process's
/// notices about them (`pdkv up`).
#[derive(Clone, Debug)]
pub struct Logs {
    pub who: &'static str,
    pub sink: LogSink,
}

/// A child process with its stderr forwarded (prefixed) to ours, written to
/// a log file, or dropped; its last lines kept.
pub struct Proc {
    pub name: String,
    child: Child,
    /// Its URL; empty until its `listening on` line when it chose its port.
    base: String,
    /// The address of its first `listening on http://ADDR` log line.
    listening: Arc<Mutex<Option<String>>>,
    tail: Arc<Mutex<VecDeque<String>>>,
}

/// `RUST_LOG` for a child whose `listening on` line (at `info`) we read:
/// the operator's filter, with the info lines of the two modules that print
/// it kept (only those two: a wider directive would hide other debug lines
/// the operator asked for).
fn child_log_filter() -> String {
    match std::env::var("RUST_LOG") {
        Ok(f) if !f.trim().is_empty() => format!("{f},pdkv::serve=info,pdkv::proxy_cmd=info"),
        _ => "info".to_string(),
    }
}

/// `EXE ARGS` as a child: stdin and stdout closed, stderr piped, and
/// SIGTERM sent to it if this process dies.
pub fn child_command(exe: &Path, args: &[String]) -> Command {
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: prctl is async-signal-safe; the closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// The URL of a `listening on http://ADDR` log line.
pub fn listening_addr(line: &str) -> Option<String> {
    let rest = line.split("listening on ").nth(1)?;
    let addr = rest.split_whitespace().next()?;
    addr.starts_with("http://").then(|| addr.to_string())
}

/// Opens the log file of child `name` when `sink` asks for one.
fn log_file(
    sink: &LogSink,
    name: &str,
) -> Result<Option<std::io::BufWriter<std::fs::File>>, DeployError> {
    let LogSink::Dir(dir) = sink else {
        return Ok(None);
    };
    let path = dir.join(format!("{}.log", name.replace(' ', "-")));
    let f = std::fs::File::create(&path).map_err(|source| DeployError::LogFile {
        path: path.clone(),
        source,
    })?;
    Ok(Some(std::io::BufWriter::new(f)))
}

/// Reads a child's stderr to its end on a thread of its own: the first
/// `listening on` address, the last lines, and each line to `sink`.
fn read_stderr(
    stderr: std::process::ChildStderr,
    name: String,
    sink: LogSink,
    mut file: Option<std::io::BufWriter<std::fs::File>>,
    listening: Arc<Mutex<Option<String>>>,
    tail: Arc<Mutex<VecDeque<String>>>,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some(addr) = listening_addr(&line) {
                let mut l = listening.lock().unwrap_or_else(|e| e.into_inner());
                l.get_or_insert(addr);
            }
            match (&sink, file.as_mut()) {
                // Flushed per line: the file is read while the child runs.
                (_, Some(f)) => {
                    let _ = writeln!(f, "{line}").and_then(|()| f.flush());
                }
                (LogSink::Stderr, None) => {
                    let _ = writeln!(std::io::stderr().lock(), "[{name}] {line}");
                }
                _ => {}
            }
            let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
            if t.len() == TAIL_LINES {
                t.pop_front();
            }
            t.push_back(line);
        }
    });
}

impl Proc {
    /// Starts `EXE ARGS` as child `name`. `secrets`: environment variables
    /// set (or removed when `None`) for the child; secrets go by
    /// environment, not argv (which `ps` shows). `port` 0: the child binds a
    /// free port itself and its URL is learned from its `listening on` line
    /// (a port chosen here and bound there could be taken by another
    /// process in between).
    pub fn spawn(
        exe: &Path,
        name: String,
        port: u16,
        args: &[String],
        secrets: &[(&str, Option<&str>)],
        logs: &Logs,
    ) -> Result<Proc, DeployError> {
        let mut cmd = child_command(exe, args);
        cmd.env("RUST_LOG", child_log_filter());
        for (k, v) in secrets {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        let file = log_file(&logs.sink, &name)?;
        let mut child = cmd.spawn().map_err(|source| DeployError::Spawn {
            name: name.clone(),
            exe: exe.to_path_buf(),
            source,
        })?;
        let on = match port {
            0 => "a port of its choosing".to_string(),
            p => format!("port {p}"),
        };
        eprintln!(
            "{}: started the {name} (pid {}) on {on}",
            logs.who,
            child.id()
        );
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
        let listening = Arc::new(Mutex::new(None));
        if let Some(stderr) = child.stderr.take() {
            read_stderr(
                stderr,
                name.clone(),
                logs.sink.clone(),
                file,
                listening.clone(),
                tail.clone(),
            );
        }
        Ok(Proc {
            name,
            child,
            base: match port {
                0 => String::new(),
                p => format!("http://{HOST}:{p}"),
            },
            listening,
            tail,
        })
    }

    /// Its URL, once known.
    pub fn url(&mut self) -> Option<&str> {
        if self.base.is_empty() {
            let l = self.listening.lock().unwrap_or_else(|e| e.into_inner());
            self.base = l.clone().unwrap_or_default();
        }
        Some(self.base.as_str()).filter(|b| !b.is_empty())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, as a crash: no shutdown runs (reaped at once).
    pub fn kill(&mut self) {
        if self.exited().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// Its exit status, once it exited (reaping it).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Its last log lines.
    pub fn tail(&self) -> String {
        self.tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn terminate(&mut self) {
        if self.exited().is_none() {
            let pid = self.child.id() as libc::pid_t;
            // SAFETY: a plain syscall on our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
    }
}

/// Fails when a child has exited, with its last log lines.
pub fn check_children(procs: &mut [Proc]) -> Result<(), DeployError> {
    for p in procs.iter_mut() {
        if let Some(status) = p.exited() {
            return Err(DeployError::Exited {
                name: p.name.clone(),
                status,
                tail: p.tail(),
            });
        }
    }
    Ok(())
}

/// SIGTERM to every child, the last first (the proxy, so no request
/// reaches a stopping server).
fn terminate_all(procs: &mut [Proc]) {
    for p in procs.iter_mut().rev() {
        p.terminate();
    }
}

fn any_running(procs: &mut [Proc]) -> bool {
    procs.iter_mut().any(|p| p.exited().is_none())
}

/// After the grace period: reports how each child ended, and kills and
/// reaps the ones still running.
fn kill_the_rest(procs: &mut [Proc], who: &str) {
    for p in procs.iter_mut() {
        match p.exited() {
            Some(status) if status.success() => {}
            Some(status) => eprintln!("{who}: the {} exited with {status}", p.name),
            None => {
                eprintln!(
                    "{who}: the {} did not stop within {}s; killing it",
                    p.name,
                    STOP_GRACE.as_secs()
                );
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
        }
    }
}

/// SIGTERM to every child (the proxy first), a bounded wait, then SIGKILL;
/// every child is reaped.
pub async fn stop_all(procs: &mut [Proc], who: &str) {
    terminate_all(procs);
    let deadline = Instant::now() + STOP_GRACE;
    while Instant::now() < deadline && any_running(procs) {
        tokio::time::sleep(STOP_POLL).await;
    }
    kill_the_rest(procs, who);
}

/// [`stop_all`] for a caller that cannot await (a `Drop`): the same steps,
/// the thread sleeping between the exit checks.
pub fn stop_all_blocking(procs: &mut [Proc], who: &str) {
    terminate_all(procs);
    let deadline = Instant::now() + STOP_GRACE;
    while Instant::now() < deadline && any_running(procs) {
        std::thread::sleep(STOP_POLL);
    }
    kill_the_rest(procs, who);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listening_lines_name_their_url() {
        assert_eq!(
            listening_addr("INFO pdkv::serve: listening on http://127.0.0.1:4321 (model x)"),
            Some("http://127.0.0.1:4321".to_string())
        );
        assert_eq!(listening_addr("listening on 127.0.0.1:4321"), None);
        assert_eq!(listening_addr("started"), None);
    }
}
