// Package preflight owns what a worker checks and prepares before its
// lanes start: the validation of a Config (ConfigError names the flag and
// its environment variable), the database role's rights and row-level
// security bindings on kfn's tables (CheckRole), and each function's Setup
// (RunSetup), which a function binary's migrate mode runs too. Package
// engine calls it from NewWorker; package process from a function
// binary's main. It is not a stable API.
package preflight
