-- kfn:breaks-before 9002
-- A test-only migration (build tag kfn_upgrade_test) that declares it breaks
-- every worker built for an older schema, as a migration that renames or
-- drops what they use would.
COMMENT ON COLUMN kfn.inbox.upgrade_test_note IS 'written by workers built for schema 9002 and later';
