//! The real CUDA driver, loaded at run time (placeholder: being written).
