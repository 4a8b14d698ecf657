#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::mem::{offset_of, size_of};
use std::path::Path;

use super::ffi::*;
use super::*;

#[test]
fn every_args_struct_is_64_bytes() {
    assert_eq!(size_of::<LockArgs>(), 64);
    assert_eq!(size_of::<CheckpointArgs>(), 64);
    assert_eq!(size_of::<UnlockArgs>(), 64);
    assert_eq!(size_of::<RestoreArgs<'_>>(), 64);
    assert_eq!(size_of::<GpuPairRaw>(), 32);
}

#[test]
fn field_offsets_match_cuda_13_header() {
    assert_eq!(offset_of!(LockArgs, timeout_ms), 0);
    assert_eq!(offset_of!(LockArgs, reserved0), 4);
    assert_eq!(offset_of!(LockArgs, reserved1), 8);
    assert_eq!(offset_of!(RestoreArgs<'_>, gpu_pairs), 0);
    assert_eq!(offset_of!(RestoreArgs<'_>, gpu_pairs_count), 8);
    assert_eq!(offset_of!(RestoreArgs<'_>, reserved), 12);
    assert_eq!(offset_of!(RestoreArgs<'_>, reserved1), 56);
    assert_eq!(offset_of!(GpuPairRaw, old_uuid), 0);
    assert_eq!(offset_of!(GpuPairRaw, new_uuid), 16);
}

#[test]
fn lock_timeout_zero_means_forever_only_for_none() {
    assert_eq!(timeout_ms(None), 0);
    assert_eq!(timeout_ms(Some(Duration::ZERO)), 1);
    assert_eq!(timeout_ms(Some(Duration::from_micros(10))), 1);
    assert_eq!(timeout_ms(Some(Duration::from_micros(1500))), 2);
    assert_eq!(timeout_ms(Some(Duration::from_secs(30))), 30_000);
    assert_eq!(timeout_ms(Some(Duration::from_secs(u64::MAX))), u32::MAX);
}

fn pair() -> GpuPair {
    GpuPair {
        old: "GPU-00112233-4455-6677-8899-aabbccddeeff".parse().unwrap(),
        new: "GPU-ffeeddcc-bbaa-9988-7766-554433221100".parse().unwrap(),
    }
}

#[test]
fn gpu_pairs_need_the_13_0_layout() {
    for v in [12080, 12090] {
        let err = restore_pairs(v, &[pair()]).unwrap_err();
        assert!(
            matches!(err, DriverError::TooOld { needed: 13000, found, .. } if found == v),
            "{err:?}"
        );
        assert!(err.to_string().contains("13000"), "{err}");
        // Without pairs the zeroed args are valid on 12.x.
        assert!(restore_pairs(v, &[]).unwrap().is_empty());
    }
    let raw = restore_pairs(13000, &[pair()]).unwrap();
    assert_eq!(
        raw[0].old_uuid,
        [
            0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd,
            0xee, 0xff
        ]
    );
    assert_eq!(raw[0].new_uuid[0], 0xff);
    assert_eq!(raw[0].new_uuid[15], 0x00);
}

#[test]
fn restore_args_point_at_the_pairs_or_stay_zeroed() {
    let raw = restore_pairs(13000, &[pair(), pair()]).unwrap();
    let args = RestoreArgs::with_pairs(&raw).unwrap();
    assert_eq!(args.gpu_pairs, raw.as_ptr());
    assert_eq!(args.gpu_pairs_count, 2);
    assert!(args.reserved.iter().all(|b| *b == 0) && args.reserved1 == 0);
    let empty = RestoreArgs::with_pairs(&[]).unwrap();
    assert!(empty.gpu_pairs.is_null());
    assert_eq!(empty.gpu_pairs_count, 0);
    let lock = LockArgs {
        timeout_ms: 5,
        ..LockArgs::default()
    };
    assert!(lock.reserved0 == 0 && lock.reserved1.iter().all(|w| *w == 0));
}

#[test]
fn states_and_unknown_states() {
    assert_eq!(state_from_raw(1, 0).unwrap(), ProcessState::Running);
    assert_eq!(state_from_raw(1, 2).unwrap(), ProcessState::Checkpointed);
    assert_eq!(state_from_raw(1, 3).unwrap(), ProcessState::Failed);
    let err = state_from_raw(42, 5).unwrap_err();
    assert!(
        matches!(err, DriverError::UnknownState { pid: 42, raw: 5 }),
        "{err:?}"
    );
    assert!(matches!(
        state_from_raw(42, -1).unwrap_err(),
        DriverError::UnknownState { raw: u32::MAX, .. }
    ));
}

#[test]
fn driver_errors_keep_the_driver_names() {
    let e = DriverError::Cuda {
        call: "cuCheckpointProcessLock",
        pid: 7,
        code: CuResult(600),
    };
    assert_eq!(
        e.to_string(),
        "cuCheckpointProcessLock on pid 7 failed: CUDA_ERROR_NOT_READY (device not ready)"
    );
    let e = DriverError::Cuda {
        call: "cuCheckpointProcessLock",
        pid: 7,
        code: CuResult(700),
    };
    assert!(e.to_string().contains("CUDA_ERROR_ILLEGAL_ADDRESS"));
    assert_eq!(e.code(), Some(CuResult::ILLEGAL_ADDRESS));
    let e = DriverError::Cuda {
        call: "cuCheckpointProcessUnlock",
        pid: 7,
        code: CuResult(12345),
    };
    assert!(e.to_string().contains("CUresult 12345"), "{e}");
}

#[test]
fn missing_library_is_a_clear_load_error() {
    let err = CudaDriver::load_from("/nonexistent/libcuda.so.1").unwrap_err();
    assert!(
        matches!(&err, DriverError::Load { library, .. } if library == "/nonexistent/libcuda.so.1"),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .starts_with("cannot load the CUDA driver (/nonexistent/libcuda.so.1)"),
        "{err}"
    );
}

#[test]
fn library_without_the_driver_symbols_is_a_load_error_naming_the_symbol() {
    let err = CudaDriver::load_from("libc.so.6").unwrap_err();
    assert!(matches!(err, DriverError::Load { .. }), "{err:?}");
    assert!(err.to_string().contains("missing symbol cuInit"), "{err}");
}

#[test]
fn default_load_matches_whether_a_driver_is_present() {
    let driver = Path::new("/proc/driver/nvidia").exists();
    let first = CudaDriver::load();
    match &first {
        Ok(d) => {
            assert!(
                driver,
                "libcuda initialised without an NVIDIA kernel driver"
            );
            assert!(d.api_version() >= 12000, "{}", d.api_version());
            assert!(d.device_count().unwrap() >= 1);
            assert_eq!(
                d.error_name(CuResult::NOT_READY).as_deref(),
                Some("CUDA_ERROR_NOT_READY")
            );
        }
        Err(e) => {
            assert!(!driver, "NVIDIA driver present but libcuda failed: {e}");
            assert!(
                matches!(e, DriverError::Load { .. } | DriverError::Init(_)),
                "{e:?}"
            );
            assert!(
                e.to_string().contains("libcuda.so.1") || matches!(e, DriverError::Init(_)),
                "{e}"
            );
            assert!(backend().is_err());
        }
    }
    // Cached: the second load gives the same answer without loading again.
    assert_eq!(CudaDriver::load().is_ok(), first.is_ok());
}
