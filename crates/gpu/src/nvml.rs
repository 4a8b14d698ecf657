//! NVML, loaded at run time (placeholder: being written).
