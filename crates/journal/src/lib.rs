//! cryo-journal (being written).
