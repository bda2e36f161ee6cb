//! RuleProgram (being written).
