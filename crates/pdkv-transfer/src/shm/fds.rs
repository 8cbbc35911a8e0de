//! Descriptors over a Unix stream socket (SCM_RIGHTS).

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use super::MAX_FDS;

/// Sends `bytes` with `fds` attached (SCM_RIGHTS) on a Unix stream socket.
pub fn send_with_fds(sock: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; zero is a valid "empty" value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer holds one header and fd_bytes of data.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr() as *const u8, libc::CMSG_DATA(c), fd_bytes);
        }
    }
    // SAFETY: msg points at live buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    (&*sock).write_all(&bytes[n as usize..])
}

/// Reads exactly `buf.len()` bytes, collecting any descriptors that arrive
/// with them; more than [`MAX_FDS`] in `fds` is refused (`InvalidData`).
pub fn recv_with_fds(sock: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let mut iov = libc::iovec {
            iov_base: buf[got..].as_mut_ptr() as *mut libc::c_void,
            iov_len: buf.len() - got,
        };
        // SAFETY: a pure size computation.
        let space =
            unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
        let mut cbuf = vec![0u64; space.div_ceil(8)];
        // SAFETY: as in send_with_fds.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space as _;
        // SAFETY: msg points at live buffers for the duration of the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: walking the control messages the kernel just wrote.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c);
                    let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                        / std::mem::size_of::<RawFd>();
                    for i in 0..count {
                        let fd = std::ptr::read_unaligned((data as *const RawFd).add(i));
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "memfds truncated",
            ));
        }
        if fds.len() > MAX_FDS {
            // A peer splitting a frame into many messages, each with memfds
            // attached: refused before it can exhaust our descriptors.
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "more memfds than one frame may carry",
            ));
        }
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += n as usize;
    }
    Ok(())
}
