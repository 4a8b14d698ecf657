//! cryo-lifecycle (being written).
