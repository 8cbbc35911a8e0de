//! Child processes under one guard: a [`Proc`] is killed and reaped on
//! drop, its output lines arrive on a channel, and every wait on it is
//! bounded by [`DEADLINE`].

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::DEADLINE;

/// The `pdkv` binary of this build: `$PDKV_BIN`, else the `pdkv` beside the
/// test executable's `deps/` folder (where cargo puts it when it builds a
/// test of the `pdkv` crate).
pub fn exe() -> PathBuf {
    if let Some(p) = std::env::var_os("PDKV_BIN") {
        return PathBuf::from(p);
    }
    let me = std::env::current_exe().expect("the test's own path");
    let bin = me
        .parent()
        .and_then(|deps| deps.parent())
        .map(|dir| dir.join("pdkv"))
        .expect("a test executable lives in <target>/<profile>/deps");
    assert!(
        bin.is_file(),
        "no pdkv binary at {} (build it, or set PDKV_BIN)",
        bin.display()
    );
    bin
}

/// `pdkv` with `RUST_LOG=info`, for a subcommand run to its end.
pub fn pdkv() -> Command {
    let mut c = Command::new(exe());
    c.env("RUST_LOG", "info");
    c
}

/// Which stream of the child a [`Proc`] reads its lines from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lines {
    Stdout,
    Stderr,
}

/// A running child process, stopped and reaped on drop if still alive: at
/// once (SIGKILL), or with [`Proc::with_grace`] by SIGTERM first (for a
/// child that has children of its own to stop, such as `pdkv up`).
pub struct Proc {
    child: Option<Child>,
    grace: Option<Duration>,
    /// `http://ADDR` from its `listening on` line, when it has one.
    pub base: String,
    /// Its output lines (of the stream it was started with) after the line
    /// it was waited for.
    pub lines: mpsc::Receiver<String>,
}

impl Proc {
    /// `pdkv ARGS...` (behind `prefix`, e.g. `ip netns exec NS`), waiting
    /// for its `listening on http://ADDR` line.
    pub fn start(prefix: &[&str], args: &[&str]) -> Proc {
        Proc::start_env(prefix, args, &[])
    }

    /// [`Proc::start`] with the variables `envs` added after
    /// `RUST_LOG=info` (so they may override it).
    pub fn start_env(prefix: &[&str], args: &[&str], envs: &[(&str, &str)]) -> Proc {
        let exe = exe();
        let mut cmd = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        cmd.env("RUST_LOG", "info")
            .envs(envs.iter().copied())
            .args(args);
        let what = format!("pdkv {}", args.join(" "));
        let mut p = Proc::spawn(cmd, Lines::Stderr, &what);
        let line = p.wait_line(&what, |l| l.contains("listening on "));
        p.base = listening_addr(&line).expect("the line was chosen for it");
        p
    }

    /// Spawns `cmd` with its `lines` stream piped to [`Proc::lines`] (the
    /// other one inherited) and stdin closed; waits for nothing.
    pub fn spawn(mut cmd: Command, lines: Lines, what: &str) -> Proc {
        cmd.stdin(Stdio::null());
        match lines {
            Lines::Stdout => cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()),
            Lines::Stderr => cmd.stdout(Stdio::null()).stderr(Stdio::piped()),
        };
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {what}: {e}"));
        let out: Box<dyn Read + Send> = match lines {
            Lines::Stdout => Box::new(child.stdout.take().expect("piped stdout")),
            Lines::Stderr => Box::new(child.stderr.take().expect("piped stderr")),
        };
        Proc {
            child: Some(child),
            grace: None,
            base: String::new(),
            lines: read_lines(out),
        }
    }

    /// The next line for which `pred` holds, bounded by [`DEADLINE`];
    /// panics with every line seen when the child ends or the deadline
    /// passes first.
    pub fn wait_line(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + DEADLINE;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if pred(&line) => return line,
                Ok(line) => seen.push(line),
                Err(e) => panic!(
                    "{what}: the line waited for never came ({e}); output:\n{}",
                    seen.join("\n")
                ),
            }
        }
    }

    /// On drop, SIGTERM and up to `grace` for the child to exit before
    /// SIGKILL.
    pub fn with_grace(mut self, grace: Duration) -> Proc {
        self.grace = Some(grace);
        self
    }

    /// `base` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("a live child").id()
    }

    /// Whether the child has exited (reaping it if so).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Kills the process at once (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends SIGTERM and waits, bounded by [`DEADLINE`], for the exit
    /// status.
    pub fn terminate(mut self) -> ExitStatus {
        let child = self.child.take().expect("a live child");
        signal(&child, libc::SIGTERM);
        wait_bounded(child, DEADLINE).expect("the child exits after SIGTERM")
    }

    /// Sends SIGTERM and waits up to `grace` for the exit, then SIGKILL.
    pub fn stop(self, grace: Duration) {
        drop(self.with_grace(grace));
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        match (self.grace, self.child.take()) {
            (Some(grace), Some(child)) => {
                signal(&child, libc::SIGTERM);
                if let Err(mut child) = wait_bounded(child, grace) {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
            (None, child) => {
                self.child = child;
                self.kill();
            }
            (Some(_), None) => {}
        }
    }
}

/// The lines of a child's `pipe`, read on a thread of their own to the
/// pipe's end. Unbounded: one message per line the child prints (a closed
/// pipe would fail the child's next write).
pub fn read_lines(pipe: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// The `http://ADDR` a server's `listening on http://ADDR` line names.
pub fn listening_addr(line: &str) -> Option<String> {
    let rest = line.split("listening on ").nth(1)?;
    Some(rest.split_whitespace().next()?.to_string())
}

fn signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on our own child's pid, which has not been reaped yet
    // (the Child is still held), so the pid cannot name another process.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill({}, {sig})", child.id());
}

/// Waits up to `within` for `child` to exit: its status, or the child back.
fn wait_bounded(mut child: Child, within: Duration) -> Result<ExitStatus, Child> {
    let deadline = Instant::now() + within;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Ok(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => return Err(child),
        }
    }
}

/// Runs `cmd` to its end, bounded by `within` (killed after it); returns
/// (success, stdout, stderr).
pub fn run_bounded(mut cmd: Command, within: Duration) -> (bool, String, String) {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    let read_all = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = read_all(Box::new(child.stdout.take().expect("piped stdout")));
    let err = read_all(Box::new(child.stderr.take().expect("piped stderr")));
    let status = match wait_bounded(child, within) {
        Ok(s) => s,
        Err(mut child) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not finish within {within:?}");
        }
    };
    (status.success(), out.join().unwrap(), err.join().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_address_comes_from_the_listening_line() {
        assert_eq!(
            listening_addr("INFO pdkv: listening on http://127.0.0.1:8100 (model x)").as_deref(),
            Some("http://127.0.0.1:8100")
        );
        assert_eq!(listening_addr("INFO starting"), None);
    }

    #[test]
    fn a_child_is_waited_for_bounded_and_its_lines_arrive() {
        let mut sh = Command::new("sh");
        sh.args(["-c", "echo one; echo two; sleep 30"]);
        let mut p = Proc::spawn(sh, Lines::Stdout, "sh");
        assert_eq!(p.wait_line("sh", |l| l == "two"), "two");
        assert!(p.exited().is_none());
        let pid = p.pid();
        drop(p);
        // SAFETY: signal 0 only asks whether `pid` still exists.
        let alive = unsafe { libc::kill(pid as libc::pid_t, 0) } == 0;
        assert!(!alive, "killed and reaped on drop");
    }

    #[test]
    fn a_bounded_run_reports_both_streams() {
        let mut sh = Command::new("sh");
        sh.args(["-c", "echo out; echo err >&2; exit 3"]);
        let (ok, out, err) = run_bounded(sh, Duration::from_secs(10));
        assert!(!ok);
        assert_eq!((out.as_str(), err.as_str()), ("out\n", "err\n"));
    }
}
