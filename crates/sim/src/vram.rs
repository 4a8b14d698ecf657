//! A simulated GPU's memory as the host backs it.
//!
//! A real GPU's memory is there from boot: a context opened on it (a restore's upload, a
//! `cudaMalloc`) costs the copy into it, never the host faulting in pages. The daemon backs device
//! memory with heap buffers, and a fresh buffer is the kernel's zeroed pages faulted in on first
//! touch; in a VM whose balloon reports free pages to the hypervisor (virtio-balloon
//! `VIRTIO_BALLOON_F_REPORTING`, this project's machines), memory freed a second or more earlier
//! has gone back to the hypervisor and costs 3-4x more to touch again (measured: 1 GiB touched at
//! once after its free 168 ms of CPU, after 1-6 s 591-697 ms). So without this pool, a restore's
//! time depended on how long ago the GPU's memory was freed: a park woken at once looked 4x
//! faster than a standby or a CRIU restore woken later, on a simulator whose real counterpart
//! has no such cost (gpu-facts.md: the GPU restore after a CRIU restore took 1.0 s for 5.8 GB,
//! after a park 1.23 s).
//!
//! [`Vram`] keeps the buffers of contexts that ended (checkpointed or torn down) for the next
//! context on the same GPU, at most the GPU's capacity in all: the host memory a GPU once used
//! stays its memory, as a GPU's memory does. What the worker's side costs (reading its host copy,
//! in small pages after CRIU) is untouched: that is the real driver's cost too.

use std::sync::Mutex;

/// The spare, already backed buffers of one GPU.
#[derive(Debug)]
pub(crate) struct Vram {
    /// The GPU's capacity: the most the spare buffers hold together.
    total: u64,
    spare: Mutex<Vec<Vec<u8>>>,
}

impl Vram {
    pub(crate) fn new(total: u64) -> Vram {
        Vram {
            total,
            spare: Mutex::new(Vec::new()),
        }
    }

    /// A buffer of `len` bytes for a new context, the smallest spare one that holds it, else a
    /// fresh one (zeros, asked for huge pages). Its contents are unspecified, as a `cudaMalloc`'s
    /// are: the caller writes all of it (a seed's fill, a restore's upload).
    pub(crate) fn take(&self, len: usize) -> Vec<u8> {
        let mut spare = self.spare();
        let best = spare
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        if let Some(i) = best {
            let mut buf = spare.swap_remove(i);
            drop(spare);
            buf.truncate(len);
            return buf;
        }
        drop(spare);
        let mut buf = vec![0u8; len];
        crate::sys::advise_huge_pages(&mut buf);
        buf
    }

    /// Keeps `buf` for the next context; the smallest spare buffers are freed first where the
    /// spare ones would hold more than the GPU's capacity.
    pub(crate) fn give(&self, mut buf: Vec<u8>) {
        if buf.capacity() == 0 {
            return;
        }
        // Whole again (its tail is already backed): a later take never writes on its path.
        buf.resize(buf.capacity(), 0);
        let mut spare = self.spare();
        spare.push(buf);
        spare.sort_by_key(|b| std::cmp::Reverse(b.capacity()));
        let mut held = 0u64;
        spare.retain(|b| {
            held = held.saturating_add(b.capacity() as u64);
            held <= self.total
        });
    }

    fn spare(&self) -> std::sync::MutexGuard<'_, Vec<Vec<u8>>> {
        self.spare.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes held in spare buffers.
    #[cfg(test)]
    fn held(&self) -> u64 {
        self.spare().iter().map(|b| b.capacity() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_buffer_backs_the_next_context_and_the_spares_stay_within_the_gpu() {
        let v = Vram::new(10 << 20);
        let a = v.take(4 << 20);
        let at = a.as_ptr();
        v.give(a);
        // The same memory, not a fresh allocation.
        let b = v.take(3 << 20);
        assert_eq!(b.as_ptr(), at);
        assert_eq!(b.len(), 3 << 20);
        v.give(b);
        // Too big for the spare: fresh; then both given back exceed the GPU: the small one goes.
        let c = v.take(8 << 20);
        assert_ne!(c.as_ptr(), at);
        v.give(c);
        assert_eq!(v.held(), 8 << 20);
        // Grows within its capacity: same memory again.
        let d = v.take(8 << 20);
        assert_eq!(d.len(), 8 << 20);
        v.give(d);
        let e = v.take(1 << 20);
        assert_eq!(e.len(), 1 << 20);
        v.give(e);
        let f = v.take(8 << 20);
        assert_eq!(f.len(), 8 << 20);
    }
}
