//! cryo-criu (being written).
