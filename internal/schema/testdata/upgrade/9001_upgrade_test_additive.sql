-- kfn:additive
-- A test-only migration (build tag kfn_upgrade_test): a nullable column on
-- the inbox, which every worker writes in each batch. Workers built for an
-- older schema name their columns and never see it.
ALTER TABLE kfn.inbox ADD COLUMN upgrade_test_note text;
CREATE INDEX inbox_upgrade_test_note ON kfn.inbox (upgrade_test_note) WHERE upgrade_test_note IS NOT NULL;
