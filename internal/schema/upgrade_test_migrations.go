//go:build kfn_upgrade_test

package schema

import "embed"

// upgradeTestFiles are migrations that exist only for the rolling-upgrade
// test (runtime's TestRollingUpgrade…): built with -tags kfn_upgrade_test, a
// binary knows them after the real ones. Their versions (9001, 9002) stay
// above every real migration's.
//
//go:embed testdata/upgrade/*.sql
var upgradeTestFiles embed.FS

func init() { testMigrations = upgradeTestFiles }
