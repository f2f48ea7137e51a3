// Package modgraph holds tests of what kfn adds to the module graph of a
// user's module: importing github.com/kfn-dev/kfn/runtime and
// runtime/worker must not bring in the repository's development tools
// (Task and its dependencies), which live in their own module,
// tools/go.mod, nor the AWS SDK, which only the opt-in module
// github.com/kfn-dev/kfn/kafkaauth/mskiam (AWS_MSK_IAM) requires.
package modgraph
