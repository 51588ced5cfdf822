//! f64 reference
