//! cryo-sim (being written).
