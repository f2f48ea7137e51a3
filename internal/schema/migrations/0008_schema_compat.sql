-- kfn:additive
-- (A nullable column that only the migrator writes and workers read.)

-- Rolling upgrades: what each applied migration breaks, so that a worker
-- built for an older schema can tell whether it may run against this one
-- without knowing the newer migrations. breaks_before is the version of
-- the marker `-- kfn:breaks-before N` at the top of the migration's file:
-- workers built for a schema older than N stop working once it is applied.
-- NULL: the migration is additive (`-- kfn:additive`) and breaks no worker.
-- The migrator fills it in for every applied migration, earlier ones too.
ALTER TABLE kfn.schema_migrations ADD COLUMN breaks_before integer;
