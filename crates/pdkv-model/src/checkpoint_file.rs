//! Opening a checkpoint's files: regular files only, and never an open()
//! that waits. A path that names a FIFO (whose open() blocks until a writer
//! comes), a device (`/dev/zero` never ends) or a socket is refused with an
//! error naming what it is.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// Opens `path` for reading if it is a regular file. The open itself does
/// not block (`O_NONBLOCK`, which a regular file's reads and mappings
/// ignore); the type is checked on the descriptor opened, so a path swapped
/// between a check and the open cannot slip through.
pub fn open(path: &Path) -> io::Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if kind.is_file() {
        return Ok(file);
    }
    let what = if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    };
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "{} is {what}; a checkpoint is read from regular files",
            path.display()
        ),
    ))
}

/// The whole of the regular file at `path`, as text.
pub fn read_to_string(path: &Path) -> io::Result<String> {
    let mut s = String::new();
    io::Read::read_to_string(&mut open(path)?, &mut s)?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_open() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("w.gguf");
        std::fs::write(&file, b"GGUF").unwrap();
        assert_eq!(read_to_string(&file).unwrap(), "GGUF");

        // A FIFO with no writer: refused at once, not an open() that waits.
        let fifo = dir.path().join("fifo.gguf");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        let made = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
        assert_eq!(made, 0);
        for (path, what) in [
            (fifo.as_path(), "a FIFO"),
            (Path::new("/dev/zero"), "a device"),
            (dir.path(), "a directory"),
        ] {
            let e = open(path).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{path:?}");
            assert!(e.to_string().contains(what), "{path:?}: {e}");
        }
        assert_eq!(
            open(&dir.path().join("missing")).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }
}
