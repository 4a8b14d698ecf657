//! A file read through a read-only mapping, so that its bytes are hashed where they lie in the
//! page cache instead of copied into a buffer first; the one way such a read fails (SIGBUS) is
//! made an error of the read, never the death of the process.
//!
//! # Why
//! The thaw's check hashes every byte of the page contents beside CRIU's restore; with `pread`
//! the kernel first copies each byte into cryo's buffer, then BLAKE3 reads it again. On this
//! project's host the copy costs as much CPU as the hash (1 GiB cached: 166 ms to copy, 167 to
//! hash from the cache, 315 for both; hashed through a mapping 247, the bytes coming from memory
//! instead of the cache), and on a two-core host that CPU is what CRIU's restorer waits for.
//!
//! # Design
//! [`Mapped::of`] maps a whole file read-only and shared (the page cache's own pages, what CRIU
//! reads through its own descriptor) and registers the range in a fixed table of [`SLOTS`].
//! [`Mapped::populate`] asks for a span's pages at once (`MADV_POPULATE_READ`: one call instead
//! of a fault every 64 KiB; a page that cannot be read is an error of that call, no signal).
//! What remains is a page lost between that call and the hash: the file truncated below it (only
//! root can write an image, and the check refuses any change anyway), or a page reclaimed and
//! then failing to read again (a bad sector, a network file system that gave up, a memory error
//! in a cached page). The kernel answers such a read with SIGBUS, whose default action ends the
//! process: for the thaw that is a death while CRIU restores. A SIGBUS handler, installed for the
//! process at the first mapping, looks the faulting address up in the table; in a registered
//! range it maps a page of zeros over the page that faulted (`MAP_FIXED`, anonymous), marks the
//! range and returns: the instruction runs again and reads zeros, and [`Mapped::faulted`] tells
//! the caller that what it read is not the file (the check refuses the image; its digest would
//! not have matched either). A SIGBUS at any other address goes to the handler that was there
//! before: Rust's own (it reports a stack overflow in a guard page and otherwise restores the
//! default action, so that the fault kills as it always did), or the default action.
//!
//! # Limitations
//! A mapping that cannot be made (the table full, a file system that refuses shared mappings
//! such as FUSE with direct I/O, no address space) is `None`: the caller reads with `pread`.
//! A SIGBUS handler that a library installs after cryo's replaces it (none in cryo does).

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// Mappings registered at once, at most (threads of checks running in one process).
pub(crate) const SLOTS: usize = 64;

/// One registered range: `start..end` (both 0: free).
struct Slot {
    start: AtomicUsize,
    end: AtomicUsize,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    faulted: AtomicBool::new(false),
};

static TABLE: [Slot; SLOTS] = [FREE; SLOTS];

/// The SIGBUS handler before cryo's (`sa_sigaction`: a function, or `SIG_DFL`/`SIG_IGN`), for
/// faults outside every registered range, and whether it takes a siginfo (`SA_SIGINFO`).
static PREVIOUS: AtomicUsize = AtomicUsize::new(libc::SIG_DFL);
static PREVIOUS_SIGINFO: AtomicBool = AtomicBool::new(false);

/// The page size, noted before the handler is installed (the handler allocates and locks
/// nothing).
static PAGE: AtomicUsize = AtomicUsize::new(4096);

/// A whole file mapped read-only, registered with the SIGBUS handler until dropped.
#[derive(Debug)]
pub(crate) struct Mapped {
    addr: *mut libc::c_void,
    len: usize,
    slot: usize,
}

// SAFETY: the mapping is read-only and owned by this value; reading it from any thread is what
// reading a `&[u8]` is, and the slot it holds is only touched through atomics.
unsafe impl Send for Mapped {}
// SAFETY: as for `Send`: nothing is written through the mapping.
unsafe impl Sync for Mapped {}

impl Mapped {
    /// Maps the first `len` bytes of `file`, or `None` if it cannot be mapped (see the
    /// module's limitations; the caller reads with `pread`).
    pub(crate) fn of(file: &std::fs::File, len: u64) -> Option<Mapped> {
        let len = usize::try_from(len).ok().filter(|&l| l > 0)?;
        if !installed() {
            return None;
        }
        let slot = TABLE.iter().position(|s| {
            s.start
                .compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        })?;
        // SAFETY: a new read-only shared mapping at an address the kernel picks, of an fd we
        // borrow for the call (the mapping keeps its own reference to the file); nothing in
        // this process is overwritten.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            tracing::debug!(error = %std::io::Error::last_os_error(), "mapping an image file: read instead");
            TABLE[slot].start.store(0, Ordering::Release);
            return None;
        }
        // Read front to back: a fault on a page that is not cached then gets the file's
        // streaming readahead, not read-around (none at all after 100 misses). The check maps
        // only spans already cached (all of them through the mapping made a cold 4 GiB thaw
        // take 7.4 s instead of 5.7); this is for a page evicted in between. Only advice: an
        // error leaves such faults slower, not wrong.
        // SAFETY: our own mapping, just made; the advice changes no content.
        let r = unsafe { libc::madvise(addr, len, libc::MADV_SEQUENTIAL) };
        if r != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "advising an image file's mapping");
        }
        let s = &TABLE[slot];
        s.faulted.store(false, Ordering::Relaxed);
        s.end.store(addr as usize + len, Ordering::Release);
        s.start.store(addr as usize, Ordering::Release);
        Some(Mapped { addr, len, slot })
    }

    /// Maps the pages of `offset..offset + len` at once (`MADV_POPULATE_READ`): an error if one
    /// cannot be read (`EIO`: the file is shorter, or its storage failed). A kernel without
    /// it (before 5.14, `EINVAL`) faults them in as they are read.
    pub(crate) fn populate(&self, offset: usize, len: usize) -> std::io::Result<()> {
        let page = rustix::param::page_size();
        let start = offset - offset % page;
        let end = offset.saturating_add(len).min(self.len);
        if end <= start {
            return Ok(());
        }
        // SAFETY: the range lies inside our own mapping (clamped to its length, the start
        // rounded down to a page boundary inside it); the advice changes no content.
        let r = unsafe {
            libc::madvise(
                self.addr.cast::<u8>().add(start).cast(),
                end - start,
                libc::MADV_POPULATE_READ,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINVAL) => Ok(()),
            // What a read would have got as SIGBUS: a page past the end, or one its storage
            // failed to read.
            Some(libc::EFAULT) => Err(std::io::Error::from_raw_os_error(libc::EIO)),
            _ => Err(e),
        }
    }

    /// Whether every page of `offset..offset + len` is in the page cache now (`mincore`): a
    /// span that is not is better read with `pread`, whose readahead streams a cold file (the
    /// faults of a mapping read it in smaller pieces).
    pub(crate) fn resident(&self, offset: usize, len: usize) -> bool {
        let page = rustix::param::page_size();
        let start = offset - offset % page;
        let end = offset.saturating_add(len).min(self.len);
        if end <= start {
            return true;
        }
        let mut vec = vec![0u8; (end - start).div_ceil(page)];
        // SAFETY: the range lies inside our own mapping; `vec` has one byte per page of it.
        let r = unsafe {
            libc::mincore(
                self.addr.cast::<u8>().add(start).cast(),
                end - start,
                vec.as_mut_ptr(),
            )
        };
        r == 0 && vec.iter().all(|b| b & 1 == 1)
    }

    /// Unmaps the pages of `offset..offset + len` from this mapping (`MADV_DONTNEED`; the page
    /// cache keeps them, for CRIU): a page hashed is not held mapped, which reclaim would favour
    /// keeping, while the rest of the file is checked. Read again, they are mapped again.
    pub(crate) fn release(&self, offset: usize, len: usize) {
        let page = rustix::param::page_size();
        let start = offset.div_ceil(page) * page;
        let end = (offset.saturating_add(len) / page * page).min(self.len);
        if end <= start {
            return;
        }
        // SAFETY: a range of whole pages inside our own read-only shared mapping; dropping
        // its page table entries changes no content (read again, the file's pages are mapped
        // again).
        unsafe {
            libc::madvise(
                self.addr.cast::<u8>().add(start).cast(),
                end - start,
                libc::MADV_DONTNEED,
            )
        };
    }

    /// The length mapped.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The mapped bytes. A page that cannot be read reads as zeros, and [`Mapped::faulted`]
    /// says so: never trust them without asking it afterwards.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `addr..addr + len` is our read-only mapping, alive as long as `self`; a page
        // that faults is replaced by zeros by the SIGBUS handler (the range is registered), so
        // every read of the slice returns.
        unsafe { std::slice::from_raw_parts(self.addr.cast::<u8>(), self.len) }
    }

    /// Whether a read of the mapping faulted since it was made: what was read is not the file.
    pub(crate) fn faulted(&self) -> bool {
        TABLE[self.slot].faulted.load(Ordering::Acquire)
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        let s = &TABLE[self.slot];
        // Out of the table first: no read of it can fault after this.
        s.start.store(usize::MAX, Ordering::Release);
        s.end.store(0, Ordering::Release);
        // SAFETY: our own mapping (and the zero pages mapped into its range), unmapped once;
        // the slice `bytes` lent cannot outlive `self`.
        unsafe { libc::munmap(self.addr, self.len) };
        s.start.store(0, Ordering::Release);
    }
}

/// Puts the SIGBUS handler in place, unless it is: whether it is. Asked at every mapping, not
/// once: a handler installed after cryo's (the agent catches every fatal signal at its start)
/// would replace it, and is chained to instead.
fn installed() -> bool {
    static LOCK: Mutex<()> = Mutex::new(());
    static PAGE_NOTED: OnceLock<()> = OnceLock::new();
    PAGE_NOTED.get_or_init(|| PAGE.store(rustix::param::page_size(), Ordering::Relaxed));
    let _one = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let ours = on_sigbus as *const () as usize;
    // SAFETY: zeroed `sigaction`s are valid (empty masks, no flags); the first call only reads
    // the current action; the second installs a handler that is async-signal-safe (atomics,
    // mmap, sigaction: see `on_sigbus`), the one before it noted first for the faults that
    // are not ours.
    unsafe {
        let mut now: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut now) != 0 {
            return false;
        }
        if now.sa_sigaction == ours {
            return true;
        }
        PREVIOUS_SIGINFO.store(now.sa_flags & libc::SA_SIGINFO != 0, Ordering::Release);
        PREVIOUS.store(now.sa_sigaction, Ordering::Release);
        let mut new: libc::sigaction = std::mem::zeroed();
        new.sa_sigaction = ours;
        new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut new.sa_mask);
        if libc::sigaction(libc::SIGBUS, &new, std::ptr::null_mut()) != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "no SIGBUS handler: image files are read, not mapped");
            return false;
        }
        true
    }
}

/// The SIGBUS handler (see the module docs). Async-signal-safe: atomics, `mmap` and
/// `sigaction` (system calls), and the previous handler.
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands a valid siginfo for a SA_SIGINFO handler; `si_addr` is the
    // faulting address for a SIGBUS the kernel raised (`si_code` > 0; one sent by a process
    // has a sender there instead, and is never ours).
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    for s in TABLE.iter().filter(|_| code > 0) {
        let start = s.start.load(Ordering::Acquire);
        let end = s.end.load(Ordering::Acquire);
        if start == 0 || start == usize::MAX || !(start..end).contains(&addr) {
            continue;
        }
        let page = PAGE.load(Ordering::Relaxed);
        let at = addr - addr % page;
        // errno is the interrupted code's: kept across the call.
        // SAFETY: __errno_location is this thread's errno, valid for the thread's life.
        let errno = unsafe { *libc::__errno_location() };
        // SAFETY: replaces one page inside a range this process mapped read-only and still
        // holds (registered until its `Drop` removes it before unmapping) by a private page of
        // zeros; nothing else lives there.
        let r = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                page,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = errno };
        if r != libc::MAP_FAILED {
            s.faulted.store(true, Ordering::Release);
            return;
        }
        // No page to put there: the fault kills, as it would without cryo.
        break;
    }
    previous(sig, info, ctx);
}

/// Hands a SIGBUS that is not ours to the action before cryo's: its handler, or the default
/// action (restored, so that the fault, run again on return, kills as it would have).
fn previous(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let handler = PREVIOUS.load(Ordering::Acquire);
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // SAFETY: a zeroed sigaction is SIG_DFL with an empty mask; sigaction is
        // async-signal-safe.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(sig, &dfl, std::ptr::null_mut());
        }
        return;
    }
    if PREVIOUS_SIGINFO.load(Ordering::Acquire) {
        // SAFETY: the previous action was installed as a SA_SIGINFO handler with this
        // signature; it gets the kernel's arguments unchanged.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(handler) };
        f(sig, info, ctx);
    } else {
        // SAFETY: the previous action was installed as a plain handler taking the signal.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
        f(sig);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    fn file_of(len: usize) -> (tempfile::NamedTempFile, Vec<u8>) {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4099) as u8).collect();
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&data).unwrap();
        f.flush().unwrap();
        (f, data)
    }

    #[test]
    fn a_mapping_reads_the_files_bytes() {
        let (f, data) = file_of(3 << 20);
        let m = Mapped::of(f.as_file(), data.len() as u64).expect("mapped");
        m.populate(4096 + 17, 1 << 20).unwrap();
        assert_eq!(m.bytes(), &data[..]);
        assert!(!m.faulted());
    }

    /// The attack: the file is truncated under the mapping after its pages were populated,
    /// then read: without the handler the process dies of SIGBUS (the test binary with it).
    #[test]
    fn a_file_truncated_under_its_mapping_is_a_fault_not_a_death() {
        let (f, data) = file_of(4 << 20);
        let m = Mapped::of(f.as_file(), data.len() as u64).expect("mapped");
        m.populate(0, data.len()).unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        let sum: u64 = m.bytes().iter().map(|&b| u64::from(b)).sum();
        assert!(
            m.faulted(),
            "the read past the new end did not fault ({sum})"
        );
        assert_eq!(&m.bytes()[..1 << 20], &data[..1 << 20]);
        assert!(m.bytes()[2 << 20..].iter().all(|&b| b == 0));
        // Populating the lost pages again is an error, not a signal.
        f.as_file().set_len(0).unwrap();
        let m2 = Mapped::of(f.as_file(), data.len() as u64).expect("mapped");
        let e = m2.populate(0, data.len()).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
        assert!(!m2.faulted());
    }

    /// The attack with a real read error: a file on a FUSE file system mapped and read, then
    /// its storage fails (the server answers reads with EIO) and its cached pages are dropped,
    /// from the mapping too: the next read of the mapping gets SIGBUS from the kernel, which
    /// ends the process without the handler.
    #[test]
    fn a_read_error_under_a_mapping_is_a_fault_not_a_death() {
        let backing = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..2usize << 20)
            .map(|i| (i * 7 + i / 4099) as u8)
            .collect();
        std::fs::write(backing.path().join("pages-1.img"), &data).unwrap();
        let mnt = tempfile::tempdir().unwrap();
        let fs = cryo_testkit::fuse::Stalling::mount_failing(backing.path(), mnt.path(), |n| {
            n == "pages-1.img"
        });
        let f = std::fs::File::open(mnt.path().join("pages-1.img")).unwrap();
        let m =
            Mapped::of(&f, data.len() as u64).expect("a file of FUSE served from the cache maps");
        m.populate(0, data.len()).unwrap();
        assert_eq!(m.bytes(), &data[..]);
        assert!(!m.faulted());
        fs.fail_reads();
        let sum: u64 = m.bytes().iter().map(|&b| u64::from(b)).sum();
        assert!(
            m.faulted(),
            "the read of the failed storage did not fault ({sum})"
        );
        // A new mapping of it: the populate is the error, no signal.
        let m2 = Mapped::of(&f, data.len() as u64).expect("mapped");
        let e = m2.populate(0, data.len()).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
        assert!(!m2.faulted());
        drop((m, m2, f));
    }

    /// A SIGBUS that is not a registered mapping's still kills, as the default action does.
    /// Run in a child (this test again, told by its environment): the handler in place, then a
    /// read past the end of a file mapped without [`Mapped`].
    #[test]
    fn a_fault_outside_every_mapping_still_kills() {
        const CHILD: &str = "CRYO_MAPPED_FAULT_OUTSIDE";
        if std::env::var_os(CHILD).is_some() {
            let (f, data) = file_of(1 << 16);
            let _ours = Mapped::of(f.as_file(), data.len() as u64).expect("mapped");
            let (g, _) = file_of(2 << 12);
            // SAFETY: the test's own read-only mapping of a file it owns, read past its end on
            // purpose.
            unsafe {
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    2 << 12,
                    libc::PROT_READ,
                    libc::MAP_SHARED,
                    g.as_file().as_raw_fd(),
                    0,
                );
                assert_ne!(p, libc::MAP_FAILED);
                g.as_file().set_len(0).unwrap();
                let v = std::ptr::read_volatile(p.cast::<u8>().add(4096));
                eprintln!("read {v} past the end and lived");
            }
            return;
        }
        use std::os::unix::process::ExitStatusExt;
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "image::mapped::tests::a_fault_outside_every_mapping_still_kills",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGBUS),
            "{:?}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn a_dropped_mapping_frees_its_slot() {
        let (f, data) = file_of(1 << 16);
        for _ in 0..SLOTS * 2 {
            let m = Mapped::of(f.as_file(), data.len() as u64).expect("mapped");
            assert_eq!(m.bytes()[100], data[100]);
        }
    }
}
