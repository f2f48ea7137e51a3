package schema

// MigrateTo is Migrate up to a version, for tests of one migration.
var MigrateTo = migrateTo

// Compatibility reads a migration's marker.
var Compatibility = compatibility
