//! cryo-guard (being written).
