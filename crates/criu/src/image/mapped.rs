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
//! # A handler installed after cryo's
//! A library that installs its own SIGBUS handler after cryo's owns the signal from then on:
//! cryo never takes it back, and reads no mapping while its handler is not the one in place
//! ([`Mapped::guarded`], asked before each span; [`Mapped::of`] makes no new mapping): those
//! spans are read with `pread`. Taking the signal back would put cryo's handler in front of one
//! that may chain to cryo's (as a well-behaved library's does: it calls the handler it
//! replaced): a fault that is no one's would then go round between the two until the signal
//! stack overflows (measured: the process died of SIGSEGV instead of SIGBUS). Reading a mapping
//! under the library's handler would hand a lost page's fault to it (one that does not chain
//! ended the process its own way). Only the default action is taken back: it is what a handler
//! of the chain restores before a fault kills, or after a *sent* SIGBUS it swallowed, and
//! nothing chains from it.
//!
//! A library that installs its handler while a span is being hashed (between the look and the
//! end of that span's hash) is given a fault of that span, if a page is lost in that same
//! moment: the handler table is the process's, and no program keeps a synchronous signal from
//! a handler installed after its own (short of interposing `sigaction`, as the JVM's `libjsig`
//! does, which misses raw system calls anyway). A handler that chains, as one sharing a
//! process must, hands it on to cryo's, and the span is an error; the check asks again after
//! the hash, and a span hashed while the handler changed is read again with `pread`, so that a
//! handler that answered the fault its own way (a page of zeros mapped there, say) cannot make
//! a span pass whose storage failed. One that ends the process on any SIGBUS ends it.
//!
//! # A SIGBUS sent, not a fault
//! A SIGBUS sent by a process (`kill -BUS`: `si_code` <= 0) is never a mapping's fault, and
//! nothing runs again when a handler returns. It gets what the action before cryo's gives it:
//! ignored, that handler's answer (the agent logs it and goes on), or the default action, which
//! ends the process with a core, as without cryo's handler; before that one line on stderr
//! names the sender, so that the end is neither silent nor taken for a crash of cryo's. Whoever
//! sends SIGBUS asks for that end (a crash, on purpose), and every command is written to be
//! safe at a SIGKILL at any point (`cli/src/defer.rs`): swallowing it would hide the request,
//! and left the default action in place, with no handler of cryo's, for the rest of the span.
//! A handler that reverts to the default action and returns (Rust's runtime's, made for a
//! fault, which runs again and meets that action) asks for the default action too, so a sent
//! signal is raised again after it. Once the default action is on its way, cryo's handler is
//! never put back over it, and nothing more is mapped.
//!
//! # Threads that block signals
//! A fault's SIGBUS blocked on the faulting thread reaches no handler: the kernel puts back the
//! default action and the process ends. The thaw's check runs on threads that block every
//! signal (the deadline layer's), so [`Mapped::guarded`], asked on the reading thread before
//! each span, unblocks SIGBUS there.
//!
//! # Async-signal safety
//! The handler loads atomics, calls `mmap` and `sigaction`, and the previous handler. `mmap`
//! is not on POSIX's list of async-signal-safe functions; what makes a function unsafe there is
//! state it shares with the code it interrupted (a lock, a heap, a buffer). The call here is
//! rustix's raw system call (inline `syscall`, no libc wrapper, errno untouched), which has
//! none in user space; in the kernel it takes the process's `mmap_lock` for writing, which the
//! faulting thread does not hold when the signal is delivered (the fault released it before the
//! return to user space), and another thread holding it only makes the handler wait. No
//! `siglongjmp`: the faulting instruction runs again and reads the zero page.
//!
//! # Limitations
//! A mapping that cannot be made (the table full, a file system that refuses shared mappings
//! such as FUSE with direct I/O, no address space, a handler installed after cryo's) is `None`:
//! the caller reads with `pread`.

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
        if !guard() {
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

    /// Whether a fault under the mapping is cryo's to handle now, on the calling thread: asked
    /// before each read of it, on the thread that reads (see the module docs); `false` when a
    /// handler installed after cryo's owns SIGBUS, and the caller reads with `pread` instead.
    /// SIGBUS is unblocked on the calling thread (see [`unblocked_here`]).
    pub(crate) fn guarded(&self) -> bool {
        guard() && unblocked_here()
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

/// Unblocks SIGBUS on the calling thread, or says it cannot be (`false`: the caller reads with
/// `pread`). A fault's SIGBUS that its thread blocks goes to no handler: the kernel puts back
/// the default action and the process ends. The image check runs on threads of the deadline
/// layer (`cryo_gpu::deadline`), which block every signal so that a process-directed one goes
/// to the command's own threads, and the check's threads inherit that mask: one page lost
/// under the hash ended the whole thaw (the agent with it). Only SIGBUS is unblocked; a sent
/// one that lands on this thread gets what it gets on any other (see the module docs).
fn unblocked_here() -> bool {
    static SAID: AtomicBool = AtomicBool::new(false);
    // SAFETY: sigsets of our own stack, emptied before use; pthread_sigmask changes only the
    // calling thread's mask.
    unsafe {
        let mut bus: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut bus);
        libc::sigaddset(&mut bus, libc::SIGBUS);
        if libc::pthread_sigmask(libc::SIG_UNBLOCK, &bus, &mut old) != 0 {
            return false;
        }
        if libc::sigismember(&old, libc::SIGBUS) == 1 && !SAID.swap(true, Ordering::Relaxed) {
            tracing::debug!(
                "SIGBUS was blocked on a thread that reads image mappings: unblocked there"
            );
        }
    }
    true
}

/// Whether cryo's SIGBUS handler was ever put in place in this process.
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Whether cryo's SIGBUS handler is the one in place, putting it there unless another handler
/// replaced it (see the module docs): at the first mapping over whatever is there (chained to),
/// later only over the default action. Asked at every mapping and before each read of one.
fn guard() -> bool {
    static LOCK: Mutex<()> = Mutex::new(());
    static PAGE_NOTED: OnceLock<()> = OnceLock::new();
    static REPLACED_SAID: AtomicBool = AtomicBool::new(false);
    PAGE_NOTED.get_or_init(|| PAGE.store(rustix::param::page_size(), Ordering::Relaxed));
    let _one = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    if ENDING.load(Ordering::Acquire) {
        return false;
    }
    let ours = on_sigbus as *const () as usize;
    // SAFETY: zeroed `sigaction`s are valid (empty masks, no flags); the first call only reads
    // the current action; the second installs a handler that is async-signal-safe (see the
    // module docs), the one before it noted first for the faults that are not ours.
    unsafe {
        let mut now: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut now) != 0 {
            return false;
        }
        if now.sa_sigaction == ours {
            return true;
        }
        if INSTALLED.load(Ordering::Acquire) && now.sa_sigaction != libc::SIG_DFL {
            if !REPLACED_SAID.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    handler = now.sa_sigaction,
                    "a SIGBUS handler was installed after cryo's: image files are read, not mapped, from now on"
                );
            }
            return false;
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
        INSTALLED.store(true, Ordering::Release);
        true
    }
}

/// The SIGBUS handler (see the module docs). Async-signal-safe: atomics, `mmap` (rustix's raw
/// system call), `sigaction`, `write` and `raise`, and the previous handler.
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands a valid siginfo for a SA_SIGINFO handler; `si_addr` is the
    // faulting address for a SIGBUS the kernel raised (`si_code` > 0); one sent by a process
    // (`si_code` <= 0) has its sender there instead, and is never a mapping's fault.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    if code <= 0 {
        sent(sig, info, ctx);
        return;
    }
    for s in TABLE.iter() {
        let start = s.start.load(Ordering::Acquire);
        let end = s.end.load(Ordering::Acquire);
        if start == 0 || start == usize::MAX || !(start..end).contains(&addr) {
            continue;
        }
        let page = PAGE.load(Ordering::Relaxed);
        let at = addr - addr % page;
        // SAFETY: replaces one page inside a range this process mapped read-only and still
        // holds (registered until its `Drop` removes it before unmapping) by a private page of
        // zeros; nothing else lives there. rustix's raw system call: nothing of libc's, errno
        // (the interrupted code's) untouched.
        let r = unsafe {
            rustix::mm::mmap_anonymous(
                at as *mut libc::c_void,
                page,
                rustix::mm::ProtFlags::READ,
                rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::FIXED,
            )
        };
        if r.is_ok() {
            s.faulted.store(true, Ordering::Release);
            return;
        }
        // No page to put there: the fault kills, as it would without cryo.
        break;
    }
    previous(sig, info, ctx);
}

/// Set once a SIGBUS is being given the default action (the process is ending): cryo's
/// handler is not put back over it (see [`guard`]), and nothing is mapped from then on.
static ENDING: AtomicBool = AtomicBool::new(false);

/// Hands a fault that is not a registered mapping's to the action before cryo's: its handler,
/// or the default action (restored, so that the fault, run again on return, kills as it would
/// have).
fn previous(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let handler = PREVIOUS.load(Ordering::Acquire);
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        ENDING.store(true, Ordering::Release);
        default_action(sig);
        return;
    }
    call(handler, sig, info, ctx);
}

/// A SIGBUS sent by a process (`kill`, `tgkill`, `sigqueue`: `si_code` <= 0): no fault, and
/// nothing runs again when the handler returns. It gets what the action before cryo's gives
/// it: ignored, or that handler's answer (the agent logs it and goes on), or the default
/// action, which ends the process with a core as it would have without cryo's handler, after
/// one line on stderr that names the sender (the end is not a fault of cryo's, nor silent).
/// A handler that reverts to the default action and returns (Rust's runtime's, made for a
/// fault, which runs again and meets that action) asks for the default action too: returning
/// would swallow a sent signal, so it is raised again.
fn sent(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let handler = PREVIOUS.load(Ordering::Acquire);
    if handler == libc::SIG_IGN {
        return;
    }
    if handler != libc::SIG_DFL {
        call(handler, sig, info, ctx);
        // SAFETY: a zeroed sigaction to fill; sigaction only reads the current action.
        let now = unsafe {
            let mut now: libc::sigaction = std::mem::zeroed();
            libc::sigaction(sig, std::ptr::null(), &mut now);
            now.sa_sigaction
        };
        if now != libc::SIG_DFL {
            return;
        }
    }
    ENDING.store(true, Ordering::Release);
    say_sent(info);
    default_action(sig);
    // SAFETY: raise is async-signal-safe; the signal stays pending (blocked in this handler)
    // and acts, with the default action, when the handler returns.
    unsafe { libc::raise(sig) };
}

/// Puts back the default action for `sig`.
fn default_action(sig: libc::c_int) {
    // SAFETY: a zeroed sigaction is SIG_DFL with an empty mask; sigaction is
    // async-signal-safe.
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(sig, &dfl, std::ptr::null_mut());
    }
}

/// Calls `handler`, the action before cryo's, with the kernel's arguments.
fn call(handler: usize, sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
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

/// Writes on stderr who sent a SIGBUS that ends the process: `write` of a line built on the
/// stack (async-signal-safe; rustix's raw system call, errno untouched).
fn say_sent(info: *mut libc::siginfo_t) {
    // SAFETY: a valid siginfo (see `on_sigbus`); for the codes read here (SI_USER, SI_QUEUE,
    // SI_TKILL) the kernel fills the sender's pid and uid.
    let (code, pid, uid) = unsafe { ((*info).si_code, (*info).si_pid(), (*info).si_uid()) };
    let mut line = [0u8; 160];
    let mut n = 0;
    let mut put = |b: &[u8]| {
        let k = b.len().min(line.len() - n);
        line[n..n + k].copy_from_slice(&b[..k]);
        n += k;
    };
    put(b"cryo: a SIGBUS sent by ");
    if matches!(code, libc::SI_USER | libc::SI_QUEUE | libc::SI_TKILL) {
        put(b"process ");
        put(decimal(&mut [0; 10], pid.unsigned_abs()));
        put(b" (uid ");
        put(decimal(&mut [0; 10], uid));
        put(b")");
    } else {
        put(b"the system (si_code -");
        put(decimal(&mut [0; 10], code.unsigned_abs()));
        put(b")");
    }
    put(b", not a fault: its default action ends this process\n");
    // SAFETY: fd 2 is borrowed for the one call; a closed stderr makes it an error, ignored.
    let stderr = unsafe { std::os::fd::BorrowedFd::borrow_raw(2) };
    let _ = rustix::io::write(stderr, &line[..n]);
}

/// `v` in decimal, written at the end of `buf`.
fn decimal(buf: &mut [u8; 10], mut v: u32) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            return &buf[i..];
        }
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

    /// A file on the testkit's FUSE mirror, mapped and read whole (its pages cached and
    /// mapped), and what holds it; dropped mapping first, mount last.
    struct OnFuse {
        m: Mapped,
        f: std::fs::File,
        fs: cryo_testkit::fuse::Stalling,
        data: Vec<u8>,
        _dirs: (tempfile::TempDir, tempfile::TempDir),
    }

    /// A 2 MiB `pages-1.img` mirrored by the FUSE file system `mount` mounts (backing
    /// directory, mount point), opened, mapped and read whole.
    fn mapped_on_fuse(
        mount: impl FnOnce(&std::path::Path, &std::path::Path) -> cryo_testkit::fuse::Stalling,
    ) -> OnFuse {
        let backing = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..2usize << 20)
            .map(|i| (i * 7 + i / 4099) as u8)
            .collect();
        std::fs::write(backing.path().join("pages-1.img"), &data).unwrap();
        let mnt = tempfile::tempdir().unwrap();
        let fs = mount(backing.path(), mnt.path());
        let f = std::fs::File::open(mnt.path().join("pages-1.img")).unwrap();
        let m =
            Mapped::of(&f, data.len() as u64).expect("a file of FUSE served from the cache maps");
        m.populate(0, data.len()).unwrap();
        assert_eq!(m.bytes(), &data[..]);
        assert!(!m.faulted());
        OnFuse {
            m,
            f,
            fs,
            data,
            _dirs: (backing, mnt),
        }
    }

    /// The attack with a real read error: a file on a FUSE file system mapped and read, then
    /// its storage fails (the server answers reads with EIO) and its cached pages are dropped,
    /// from the mapping too: the next read of the mapping gets SIGBUS from the kernel, which
    /// ends the process without the handler.
    #[test]
    fn a_read_error_under_a_mapping_is_a_fault_not_a_death() {
        let on = mapped_on_fuse(|backing, mnt| {
            cryo_testkit::fuse::Stalling::mount_failing(backing, mnt, |n| n == "pages-1.img")
        });
        let (m, f, data) = (&on.m, &on.f, &on.data);
        on.fs.fail_reads();
        let sum: u64 = m.bytes().iter().map(|&b| u64::from(b)).sum();
        assert!(
            m.faulted(),
            "the read of the failed storage did not fault ({sum})"
        );
        // A new mapping of it: the populate is the error, no signal.
        let m2 = Mapped::of(f, data.len() as u64).expect("mapped");
        let e = m2.populate(0, data.len()).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
        assert!(!m2.faulted());
        drop(m2);
    }

    /// Set in the child process of a test run again by [`in_child`]: which part to play.
    const CHILD: &str = "CRYO_MAPPED_TEST_CHILD";

    /// Runs test `name` of this module again in a child process, told by its environment to
    /// play its child's part, and returns how the child ended and what it wrote on stderr. A
    /// child that outlives [`CHILD_BOUND`] is ended by its own `alarm` (SIGALRM): a fault that
    /// loops (a handler chain that returns to the same fault) fails the test instead of hanging
    /// it. What it said: its stderr, then its stdout.
    fn in_child(
        name: &str,
        env: &[(&str, &std::path::Path)],
    ) -> (std::process::ExitStatus, String) {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &format!("image::mapped::tests::{name}")])
            .env(CHILD, name)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        // libtest prints a failing child's panic on stdout.
        (
            out.status,
            String::from_utf8_lossy(&out.stderr).into_owned()
                + &String::from_utf8_lossy(&out.stdout),
        )
    }

    /// Seconds a child of [`in_child`] may run.
    const CHILD_BOUND: u32 = 30;

    /// Whether this process is the child of [`in_child`] for test `name`; if so its bound is
    /// set.
    fn child_of(name: &str) -> bool {
        if std::env::var_os(CHILD).is_none_or(|v| v != name) {
            return false;
        }
        // SAFETY: alarm only arms this process's timer.
        unsafe { libc::alarm(CHILD_BOUND) };
        true
    }

    /// Reads a byte past the end of a file mapped without [`Mapped`]: a SIGBUS at an address
    /// no registered mapping holds.
    fn fault_outside_every_mapping() {
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
    }

    /// How a child that must die of the fault died, for the failure message.
    fn died_of_sigbus(status: std::process::ExitStatus, stderr: &str) {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status.signal(),
            Some(libc::SIGBUS),
            "{status:?}: not SIGBUS (SIGALRM: it looped on its fault for {CHILD_BOUND} s): {stderr}"
        );
    }

    /// A SIGBUS that is not a registered mapping's still kills, as the default action does.
    /// Run in a child: the handler in place, then a read past the end of a file mapped without
    /// [`Mapped`].
    #[test]
    fn a_fault_outside_every_mapping_still_kills() {
        const NAME: &str = "a_fault_outside_every_mapping_still_kills";
        if child_of(NAME) {
            let (f, data) = file_of(1 << 16);
            let _ours = Mapped::of(f.as_file(), data.len() as u64).expect("mapped");
            fault_outside_every_mapping();
            return;
        }
        let (status, stderr) = in_child(NAME, &[]);
        died_of_sigbus(status, &stderr);
    }

    /// The SIGBUS action a library installed after cryo's (what [`foreign`] replaced).
    static FOREIGN_PREVIOUS: AtomicUsize = AtomicUsize::new(libc::SIG_DFL);

    /// A well-behaved library's SIGBUS handler: no fault is its own, each goes to the handler
    /// it replaced (cryo's), or the default action.
    extern "C" fn foreign_chaining(
        sig: libc::c_int,
        info: *mut libc::siginfo_t,
        ctx: *mut libc::c_void,
    ) {
        let prev = FOREIGN_PREVIOUS.load(Ordering::Acquire);
        if prev == libc::SIG_DFL || prev == libc::SIG_IGN {
            // SAFETY: signal(2) with SIG_DFL, async-signal-safe.
            unsafe { libc::signal(sig, libc::SIG_DFL) };
            return;
        }
        // SAFETY: the test installs this only over cryo's handler, a SA_SIGINFO one.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(prev) };
        f(sig, info, ctx);
    }

    /// A library's SIGBUS handler that ends the process its own way (exit code 42).
    extern "C" fn foreign_ending(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(42) };
    }

    /// Installs `handler` for SIGBUS as a library would, after cryo's, noting the one before.
    fn foreign(handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void)) {
        // SAFETY: zeroed sigactions are valid; the handler is async-signal-safe.
        unsafe {
            let mut new: libc::sigaction = std::mem::zeroed();
            new.sa_sigaction = handler as *const () as usize;
            new.sa_flags = libc::SA_SIGINFO;
            let mut old: libc::sigaction = std::mem::zeroed();
            assert_eq!(libc::sigaction(libc::SIGBUS, &new, &mut old), 0);
            FOREIGN_PREVIOUS.store(old.sa_sigaction, Ordering::Release);
        }
    }

    /// The attack on the chain: a library installs its handler after cryo's, chaining to
    /// cryo's (as it should), then the check maps another file. Taking SIGBUS back then would
    /// make cryo's handler chain to the library's, which chains to cryo's: a fault that is
    /// no one's would go round for ever (on the signal stack, until it overflows) instead of
    /// killing with SIGBUS.
    #[test]
    fn a_later_handler_that_chains_to_ours_makes_no_loop() {
        const NAME: &str = "a_later_handler_that_chains_to_ours_makes_no_loop";
        if child_of(NAME) {
            let (f, data) = file_of(1 << 16);
            let _a = Mapped::of(f.as_file(), data.len() as u64).expect("mapped");
            foreign(foreign_chaining);
            let _b = Mapped::of(f.as_file(), data.len() as u64);
            fault_outside_every_mapping();
            return;
        }
        let (status, stderr) = in_child(NAME, &[]);
        died_of_sigbus(status, &stderr);
    }

    /// The attack on the window: a mapping is made, then a library installs a SIGBUS handler
    /// of its own that does not chain (it ends the process its own way), then a page of the
    /// mapping is lost (the file truncated) and the check reads it. The fault must be cryo's
    /// error, never the library's death.
    #[test]
    fn a_mapping_made_before_a_later_handler_is_not_read_under_it() {
        const NAME: &str = "a_mapping_made_before_a_later_handler_is_not_read_under_it";
        if child_of(NAME) {
            let (f, data) = file_of(4 << 20);
            let m = Mapped::of(f.as_file(), data.len() as u64).expect("mapped");
            m.populate(0, data.len()).unwrap();
            assert!(m.guarded());
            foreign(foreign_ending);
            f.as_file().set_len(1 << 20).unwrap();
            // What the check asks before each span: the mapping is read only while a fault
            // under it is cryo's.
            if m.guarded() {
                let sum: u64 = m.bytes().iter().map(|&b| u64::from(b)).sum();
                assert!(m.faulted(), "no fault ({sum})");
            }
            assert!(!m.guarded(), "read under the later handler");
            assert!(
                Mapped::of(f.as_file(), data.len() as u64).is_none(),
                "mapped under the later handler"
            );
            return;
        }
        let (status, stderr) = in_child(NAME, &[]);
        assert!(status.success(), "{status:?}: {stderr}");
    }

    /// The table full (a long-lived agent whose abandoned checks hold their mappings, or
    /// checks at once on many threads): no new mapping, and the check reads with `pread`, with
    /// the same verdicts.
    #[test]
    fn a_full_table_reads_with_pread_and_gives_the_same_verdicts() {
        use crate::image::hash::{check_spans_in_order, Span, SpanError};
        use crate::image::manifest::DigestAlg;
        const CHUNK: usize = 64 << 10;
        let (f, mut data) = file_of(20 * CHUNK + 1234);
        let digests: Vec<String> = data
            .chunks(CHUNK)
            .map(|c| crate::image::hash::digest(DigestAlg::Blake3, c))
            .collect();
        let spans: Vec<Span<'_>> = digests
            .iter()
            .enumerate()
            .map(|(k, d)| Span {
                file: 0,
                offset: (k * CHUNK) as u64,
                len: CHUNK.min(data.len() - k * CHUNK) as u64,
                digest: d,
                last: k + 1 == digests.len(),
            })
            .collect();
        let held: Vec<Mapped> = (0..SLOTS)
            .map(|_| Mapped::of(f.as_file(), data.len() as u64).expect("a free slot"))
            .collect();
        assert!(
            Mapped::of(f.as_file(), data.len() as u64).is_none(),
            "mapped past the table"
        );
        let open = |_| std::fs::File::open(f.path());
        // Just written: every page cached, what the check maps when it can.
        for threads in [1, 3] {
            check_spans_in_order(&spans, DigestAlg::Blake3, threads, open).unwrap();
        }
        data[7 * CHUNK + 5] ^= 1;
        std::fs::write(f.path(), &data).unwrap();
        let (i, e) = check_spans_in_order(&spans, DigestAlg::Blake3, 1, open).unwrap_err();
        assert!(i == 7 && matches!(e, SpanError::Mismatch), "{i}: {e:?}");
        std::fs::write(f.path(), &data[..data.len() - 10]).unwrap();
        let (i, e) = check_spans_in_order(&spans, DigestAlg::Blake3, 1, open).unwrap_err();
        assert!(i == 7 && matches!(e, SpanError::Mismatch), "{i}: {e:?}");
        data[7 * CHUNK + 5] ^= 1;
        std::fs::write(f.path(), &data[..data.len() - 10]).unwrap();
        let (i, e) = check_spans_in_order(&spans, DigestAlg::Blake3, 3, open).unwrap_err();
        assert!(
            i == 20 && matches!(e, SpanError::Short { .. }),
            "{i}: {e:?}"
        );
        drop(held);
        assert!(Mapped::of(f.as_file(), data.len() as u64).is_some());
    }

    /// The attack on the refault path: pages of a mapped file evicted between the look
    /// (`mincore`), the populate and the hash. The check runs in a child in a memory cgroup of
    /// its own whose limit is a quarter of the file, so that the page cache cannot hold what
    /// one span maps and reclaim takes pages from under the hash, while another thread drops
    /// the file's unmapped pages (`POSIX_FADV_DONTNEED`) all along. Every span must get the
    /// verdict its bytes deserve (or an error), never a death, never a pass of a span whose
    /// digest is wrong.
    #[test]
    fn pages_evicted_under_the_hash_are_read_again_for_the_right_verdict() {
        const NAME: &str = "pages_evicted_under_the_hash_are_read_again_for_the_right_verdict";
        const SIZE: usize = 128 << 20;
        const CHUNK: usize = 4 << 20;
        const LIMIT: u64 = 32 << 20;
        use crate::image::hash::SpanError;
        use crate::image::hash::{check_span_mapped, check_spans_in_order, digest, Span};
        use crate::image::manifest::DigestAlg;
        if child_of(NAME) {
            let dir = std::path::PathBuf::from(std::env::var_os("CRYO_MAPPED_TEST_DIR").unwrap());
            let cgroup = std::env::var_os("CRYO_MAPPED_TEST_CGROUP").unwrap();
            std::fs::write(
                std::path::Path::new(&cgroup).join("cgroup.procs"),
                std::process::id().to_string(),
            )
            .unwrap();
            let digests = std::fs::read_to_string(dir.join("digests")).unwrap();
            let digests: Vec<&str> = digests.lines().collect();
            let (whole, chunks) = digests.split_last().unwrap();
            let path = dir.join("data");
            let f = std::fs::File::open(&path).unwrap();
            let stop = AtomicBool::new(false);
            std::thread::scope(|sc| {
                sc.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        let _ = rustix::fs::fadvise(&f, 0, 0, rustix::fs::Advice::DontNeed);
                    }
                });
                let span = |k: usize, d| Span {
                    file: 0,
                    offset: (k * CHUNK) as u64,
                    len: CHUNK as u64,
                    digest: d,
                    last: false,
                };
                let faults = || {
                    // SAFETY: getrusage fills the struct given.
                    unsafe {
                        let mut u: libc::rusage = std::mem::zeroed();
                        libc::getrusage(libc::RUSAGE_SELF, &mut u);
                        u.ru_majflt
                    }
                };
                let m = Mapped::of(&f, SIZE as u64).expect("mapped");
                for _ in 0..2 {
                    for (k, d) in chunks.iter().enumerate() {
                        if let Err(e) = check_span_mapped(&m, &f, &span(k, d), DigestAlg::Blake3) {
                            panic!("span {k} of a file that did not change: {e:?}");
                        }
                    }
                }
                // One span four times the limit: what populate mapped first is reclaimed
                // before the hash reaches it, and read again by the faults of the hash.
                let before = faults();
                let all = Span {
                    file: 0,
                    offset: 0,
                    len: SIZE as u64,
                    digest: whole,
                    last: true,
                };
                let r = check_span_mapped(&m, &f, &all, DigestAlg::Blake3);
                let refaults = faults() - before;
                assert!(r.is_ok(), "the whole file: {r:?} ({refaults} major faults)");
                assert!(refaults > 0, "nothing was read again under the hash");
                std::fs::write(dir.join("refaults"), refaults.to_string()).unwrap();
                let wrong = digest(DigestAlg::Blake3, b"not these bytes");
                for k in [0, 13, chunks.len() - 1] {
                    let r = check_span_mapped(&m, &f, &span(k, &wrong), DigestAlg::Blake3);
                    assert!(matches!(r, Err(SpanError::Mismatch)), "span {k}: {r:?}");
                }
                assert!(!m.faulted());
                drop(m);
                // The check as the thaw runs it: mapped where the look finds a span cached.
                let mut spans: Vec<Span<'_>> =
                    chunks.iter().enumerate().map(|(k, d)| span(k, d)).collect();
                spans.last_mut().unwrap().last = true;
                let open = |_| std::fs::File::open(&path);
                for _ in 0..3 {
                    check_spans_in_order(&spans, DigestAlg::Blake3, 2, open).unwrap();
                }
                spans[21].digest = &wrong;
                let (i, e) = check_spans_in_order(&spans, DigestAlg::Blake3, 2, open).unwrap_err();
                assert!(i == 21 && matches!(e, SpanError::Mismatch), "{i}: {e:?}");
                stop.store(true, Ordering::Relaxed);
            });
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..SIZE).map(|i| (i * 13 + i / 777) as u8).collect();
        let mut digests: Vec<String> = data
            .chunks(CHUNK)
            .map(|c| digest(DigestAlg::Blake3, c))
            .collect();
        digests.push(digest(DigestAlg::Blake3, &data));
        std::fs::write(dir.path().join("digests"), digests.join("\n")).unwrap();
        let f = std::fs::File::create(dir.path().join("data")).unwrap();
        (&f).write_all(&data).unwrap();
        f.sync_all().unwrap();
        // Not cached: the child's reads are charged to its cgroup.
        rustix::fs::fadvise(&f, 0, 0, rustix::fs::Advice::DontNeed).unwrap();
        drop(data);
        let cg = cryo_testkit::cgroup::TestCgroup::new("mapped-refault", LIMIT);
        let (status, stderr) = in_child(
            NAME,
            &[
                ("CRYO_MAPPED_TEST_DIR", dir.path()),
                ("CRYO_MAPPED_TEST_CGROUP", cg.path()),
            ],
        );
        let read_to_string = |p: std::path::PathBuf| std::fs::read_to_string(p).unwrap();
        let most: u64 = read_to_string(cg.path().join("memory.max_usage_in_bytes"))
            .trim()
            .parse()
            .unwrap();
        assert!(status.success(), "{status:?}: {stderr}");
        // The limit met: reclaim took the file's pages from under the check.
        assert!(
            most >= LIMIT,
            "the cgroup never reached its limit ({most} bytes): no pressure"
        );
        eprintln!(
            "the whole file's span (4 times the limit): {} major faults; at most {most} bytes charged",
            read_to_string(dir.path().join("refaults"))
        );
    }

    /// The attack on a check abandoned in a fault: a mapped file's storage stops answering
    /// (FUSE, the testkit's `Stalling`, reads held) after its pages were dropped, and a thread
    /// reads the mapping: it waits in the fault for good, as a check thread the restore's
    /// deadline gave up on does in a long-lived agent. The rest of the process must go on:
    /// mappings made and dropped, threads started, other files checked through mappings (the
    /// table has room for every other slot), and the stuck read must end as an error or with
    /// the file's bytes once the storage answers, never as a death.
    #[test]
    fn a_read_stuck_in_a_fault_on_a_hung_fs_holds_only_its_slot() {
        use crate::image::hash::{check_spans_in_order, digest};
        use crate::image::manifest::DigestAlg;
        let on = mapped_on_fuse(|backing, mnt| {
            cryo_testkit::fuse::Stalling::mount_cached(backing, mnt, |n| n == "pages-1.img")
        });
        let (m, fs, data) = (&on.m, &on.fs, &on.data);
        fs.hold_own();
        let bound = std::time::Duration::from_secs(30);
        /// Answers what is held when dropped: a failing test unwinds before the scope joins
        /// the stuck thread, which would otherwise wait for good.
        struct Answer<'a>(&'a cryo_testkit::fuse::Stalling);
        impl Drop for Answer<'_> {
            fn drop(&mut self) {
                self.0.answer_all();
            }
        }
        std::thread::scope(|sc| {
            let answer = Answer(fs);
            let stuck = sc.spawn(|| m.bytes().iter().map(|&b| u64::from(b)).sum::<u64>());
            cryo_testkit::eventually(bound, "the mapping's read to be held", || fs.held() > 0);
            // The rest of the process, each step bounded: a fault that held the process's
            // memory map would stop it here.
            let (done, rest) = std::sync::mpsc::channel();
            sc.spawn(move || {
                let (g, other) = file_of(1 << 20);
                let held: Vec<Mapped> = (1..SLOTS)
                    .map(|_| Mapped::of(g.as_file(), other.len() as u64).expect("a free slot"))
                    .collect();
                assert!(Mapped::of(g.as_file(), other.len() as u64).is_none());
                drop(held);
                let d = digest(DigestAlg::Blake3, &other);
                let span = [whole_file(&d, other.len(), true)];
                let open = |_| std::fs::File::open(g.path());
                check_spans_in_order(&span, DigestAlg::Blake3, 2, open).unwrap();
                done.send(()).unwrap();
            });
            rest.recv_timeout(bound)
                .expect("the process stopped while one read waited in a fault");
            assert!(!stuck.is_finished(), "the held read returned");
            drop(answer);
            // The held read answered EIO: the fault is an error, or (the kernel asked again
            // once the server answers every request) the file's bytes. Never a death.
            let sum = stuck.join().unwrap();
            assert!(
                m.faulted() || m.bytes() == &data[..],
                "the read returned neither a fault nor the file ({sum})"
            );
        });
    }

    /// The attack of the thaw's threads: the check runs on threads that block every signal
    /// (the deadline layer's carriers, `cryo_gpu::deadline`, and the threads they start), and
    /// a page of a mapping it reads is lost (the file truncated). A blocked fault signal reaches
    /// no handler: the kernel kills the process. Asked before the read, as the check asks,
    /// [`Mapped::guarded`] must make the read a fault of the mapping, never a death.
    #[test]
    fn a_thread_that_blocks_every_signal_reads_a_lost_page_as_a_fault() {
        const NAME: &str = "a_thread_that_blocks_every_signal_reads_a_lost_page_as_a_fault";
        if child_of(NAME) {
            std::thread::spawn(|| {
                // SAFETY: a full sigset of our own stack; the calling thread's mask only.
                unsafe {
                    let mut all: libc::sigset_t = std::mem::zeroed();
                    libc::sigfillset(&mut all);
                    assert_eq!(
                        libc::pthread_sigmask(libc::SIG_BLOCK, &all, std::ptr::null_mut()),
                        0
                    );
                }
                let (f, data) = file_of(4 << 20);
                let m = Mapped::of(f.as_file(), data.len() as u64).expect("mapped");
                m.populate(0, data.len()).unwrap();
                f.as_file().set_len(1 << 20).unwrap();
                assert!(m.guarded(), "read with pread: nothing attacked");
                let sum: u64 = m.bytes().iter().map(|&b| u64::from(b)).sum();
                assert!(m.faulted(), "no fault ({sum})");
            })
            .join()
            .unwrap();
            return;
        }
        let (status, stderr) = in_child(NAME, &[]);
        assert!(status.success(), "{status:?}: {stderr}");
    }

    /// How many SIGBUS the test's later handlers were given.
    static FOREIGN_SEEN: AtomicUsize = AtomicUsize::new(0);

    /// [`foreign_chaining`], counting what it was given.
    extern "C" fn foreign_chaining_counted(
        sig: libc::c_int,
        info: *mut libc::siginfo_t,
        ctx: *mut libc::c_void,
    ) {
        FOREIGN_SEEN.fetch_add(1, Ordering::Relaxed);
        foreign_chaining(sig, info, ctx);
    }

    /// A library's SIGBUS handler that takes every fault for its own and answers it its own
    /// way: a page of zeros mapped where it faulted (as cryo's does in its ranges), nothing
    /// handed on.
    extern "C" fn foreign_zeroing(
        _: libc::c_int,
        info: *mut libc::siginfo_t,
        _: *mut libc::c_void,
    ) {
        FOREIGN_SEEN.fetch_add(1, Ordering::Relaxed);
        // SAFETY: a kernel-raised SIGBUS's siginfo; the page replaced is the test's own
        // read-only file mapping, by a private page of zeros.
        unsafe {
            let at = (*info).si_addr() as usize & !4095;
            let _ = rustix::mm::mmap_anonymous(
                at as *mut libc::c_void,
                4096,
                rustix::mm::ProtFlags::READ,
                rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::FIXED,
            );
        }
    }

    /// The SIGBUS action in place now.
    fn sigbus_action() -> usize {
        // SAFETY: a zeroed sigaction to fill; only read.
        unsafe {
            let mut now: libc::sigaction = std::mem::zeroed();
            assert_eq!(libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut now), 0);
            now.sa_sigaction
        }
    }

    /// The attack on the moment between the look before a span and the end of its hash (the
    /// child's part): a span of a file on FUSE, checked as the thaw checks it (cached, so
    /// mapped), its pages dropped between the populate and the hash, whose first fault waits on
    /// a read the server holds until another thread has installed `handler` as a library would
    /// (after cryo's); then the storage fails (`EIO`): the fault is the later handler's. The
    /// span's storage failed: its verdict must be an I/O error, whatever the handler did with
    /// the fault, and SIGBUS must stay the library's.
    fn a_handler_installed_during_a_span(
        handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void),
    ) {
        use crate::image::hash::{check_spans_in_order, digest, SpanError, AFTER_POPULATE};
        use crate::image::manifest::DigestAlg;
        let backing = tempfile::tempdir().unwrap();
        // Zeros: what a handler that maps zeros makes the hash read too.
        std::fs::write(backing.path().join("pages-1.img"), vec![0u8; 2 << 20]).unwrap();
        let mnt = tempfile::tempdir().unwrap();
        let fs = std::sync::Arc::new(cryo_testkit::fuse::Stalling::mount_cached(
            backing.path(),
            mnt.path(),
            |n| n == "pages-1.img",
        ));
        let path = mnt.path().join("pages-1.img");
        let data = std::fs::read(&path).unwrap();
        let d = digest(DigestAlg::Blake3, &data);
        // Not the last: the verdict is the hash's alone (no read of the end after it).
        let spans = [whole_file(&d, data.len(), false)];
        // Each open of a FUSE file drops what was cached of it (no `FOPEN_KEEP_CACHE`): read
        // whole once opened, so that the check finds it cached and maps it.
        let open = |_| {
            let f = std::fs::File::open(&path)?;
            std::io::copy(&mut &f, &mut std::io::sink())?;
            Ok(f)
        };
        check_spans_in_order(&spans, DigestAlg::Blake3, 1, open).unwrap();
        let ours = sigbus_action();
        assert_eq!(ours, on_sigbus as *const () as usize, "not mapped");
        let hooked = std::sync::Arc::clone(&fs);
        *AFTER_POPULATE.lock().unwrap() = Some(Box::new(move || hooked.hold_own()));
        let r = std::thread::scope(|sc| {
            sc.spawn(|| {
                cryo_testkit::eventually(
                    std::time::Duration::from_secs(20),
                    "the hash's fault to wait on a held read",
                    || fs.held() > 0,
                );
                foreign(handler);
                fs.fail_all();
            });
            check_spans_in_order(&spans, DigestAlg::Blake3, 1, open)
        });
        AFTER_POPULATE.lock().unwrap().take();
        assert!(
            FOREIGN_SEEN.load(Ordering::Relaxed) > 0,
            "the later handler was never given the span's fault: no attack"
        );
        assert_eq!(
            sigbus_action(),
            handler as *const () as usize,
            "cryo took SIGBUS back from the later handler"
        );
        assert!(
            matches!(r, Err((0, SpanError::Io(_)))),
            "a span whose storage failed under its hash: {r:?}"
        );
    }

    /// A library that chains (as one sharing a process must) hands the span's fault on to
    /// cryo's handler: the span is an error, and SIGBUS stays the library's.
    #[test]
    fn a_chaining_handler_installed_during_a_span_hands_its_fault_on() {
        const NAME: &str = "a_chaining_handler_installed_during_a_span_hands_its_fault_on";
        if child_of(NAME) {
            a_handler_installed_during_a_span(foreign_chaining_counted);
            return;
        }
        let (status, stderr) = in_child(NAME, &[]);
        assert!(status.success(), "{status:?}: {stderr}");
    }

    /// A library that answers every fault its own way (a page of zeros, nothing handed on):
    /// the span's bytes then read as zeros, a file of zeros' digest: the span must still be
    /// the error its storage gave, never a pass.
    #[test]
    fn a_handler_installed_during_a_span_that_answers_its_fault_cannot_make_it_pass() {
        const NAME: &str =
            "a_handler_installed_during_a_span_that_answers_its_fault_cannot_make_it_pass";
        if child_of(NAME) {
            a_handler_installed_during_a_span(foreign_zeroing);
            return;
        }
        let (status, stderr) = in_child(NAME, &[]);
        assert!(status.success(), "{status:?}: {stderr}");
    }

    /// Set in the child of [`a_sent_sigbus_is_not_swallowed`]: the action before cryo's is
    /// the default one (as Rust's runtime leaves it after its handler ran once), not Rust's.
    const DEFAULT_BEFORE: &str = "CRYO_MAPPED_TEST_DEFAULT_BEFORE";

    /// The attack of `kill -BUS` on a process that maps images (the thaw's `cryo`): a SIGBUS
    /// sent while a mapping is held (the check running), and once it is dropped (after).
    /// Before cryo's handler was Rust's runtime's (what `cryo` has), or the default action.
    /// A sent SIGBUS is no fault: it must neither be swallowed nor end the process silently.
    /// It must end it with SIGBUS, as without cryo's handler, after a line naming the sender.
    #[test]
    fn a_sent_sigbus_is_not_swallowed() {
        const NAME: &str = "a_sent_sigbus_is_not_swallowed";
        if child_of(NAME) {
            if std::env::var_os(DEFAULT_BEFORE).is_some() {
                // SAFETY: signal(2) with SIG_DFL, before any thread of the test's.
                unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
            }
            // Past libtest's capture of `eprintln!`, as the handler's line is.
            writeln!(std::io::stderr(), "pid {}", std::process::id()).unwrap();
            let (f, data) = file_of(1 << 20);
            let m = Mapped::of(f.as_file(), data.len() as u64).expect("mapped");
            assert_eq!(m.bytes(), &data[..]);
            let held = std::env::var_os("CRYO_MAPPED_TEST_HELD").is_some();
            if !held {
                drop(m);
            }
            // SAFETY: kill(2) of this process.
            unsafe { libc::kill(libc::getpid(), libc::SIGBUS) };
            eprintln!("lived past a sent SIGBUS");
            return;
        }
        let yes = std::path::Path::new("1");
        for env in [
            vec![("CRYO_MAPPED_TEST_HELD", yes)],
            vec![],
            vec![("CRYO_MAPPED_TEST_HELD", yes), (DEFAULT_BEFORE, yes)],
        ] {
            let (status, stderr) = in_child(NAME, &env);
            died_of_sigbus(status, &stderr);
            let pid = stderr
                .lines()
                .find_map(|l| l.strip_prefix("pid "))
                .expect("the child's pid");
            assert!(
                stderr.contains(&format!(
                    "a SIGBUS sent by process {pid} (uid {}), not a fault",
                    rustix::process::getuid().as_raw()
                )),
                "{env:?}: the end does not say who sent it: {stderr}"
            );
        }
    }

    /// A handler before cryo's that has its own answer to a sent SIGBUS (the agent's: it logs
    /// it and goes on) gives it: the process lives, no mapping is taken for faulted, and
    /// cryo's handler stays in place (a page lost later is still a fault, not a death).
    #[test]
    fn a_sent_sigbus_gets_the_earlier_handlers_answer_and_leaves_ours_in_place() {
        const NAME: &str =
            "a_sent_sigbus_gets_the_earlier_handlers_answer_and_leaves_ours_in_place";
        /// The agent's way (`agent/src/sys.rs`): a sent signal is noted, a fault gets the
        /// default action.
        extern "C" fn agent_like(
            sig: libc::c_int,
            info: *mut libc::siginfo_t,
            _: *mut libc::c_void,
        ) {
            // SAFETY: the kernel's siginfo; signal(2) is async-signal-safe.
            unsafe {
                if (*info).si_code > 0 {
                    libc::signal(sig, libc::SIG_DFL);
                } else {
                    FOREIGN_SEEN.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if child_of(NAME) {
            foreign(agent_like);
            let (f, data) = file_of(4 << 20);
            let m = Mapped::of(f.as_file(), data.len() as u64).expect("mapped");
            m.populate(0, data.len()).unwrap();
            // SAFETY: kill(2) of this process.
            unsafe { libc::kill(libc::getpid(), libc::SIGBUS) };
            cryo_testkit::eventually(
                std::time::Duration::from_secs(20),
                "the sent SIGBUS to reach the earlier handler",
                || FOREIGN_SEEN.load(Ordering::Relaxed) == 1,
            );
            assert!(!m.faulted(), "a sent SIGBUS taken for a mapping's fault");
            assert!(
                m.guarded(),
                "cryo's handler not in place after a sent SIGBUS"
            );
            f.as_file().set_len(1 << 20).unwrap();
            let sum: u64 = m.bytes().iter().map(|&b| u64::from(b)).sum();
            assert!(m.faulted(), "no fault ({sum})");
            return;
        }
        let (status, stderr) = in_child(NAME, &[]);
        assert!(status.success(), "{status:?}: {stderr}");
    }

    /// One span over the first `len` bytes of file 0, of digest `d`.
    fn whole_file(d: &str, len: usize, last: bool) -> crate::image::hash::Span<'_> {
        crate::image::hash::Span {
            file: 0,
            offset: 0,
            len: len as u64,
            digest: d,
            last,
        }
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
