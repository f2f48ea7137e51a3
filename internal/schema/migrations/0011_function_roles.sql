-- kfn:additive
-- (Row-level security that binds each role that could touch kfn's rows
-- before it to every function: workers and operators already running keep
-- seeing and writing what they did.)

-- Each function isolated in Postgres. A function's workers may run under a
-- role of their own that touches only that function's rows of kfn's tables
-- (its cursors, inbox, event inbox, dead letters, parked keys, subject
-- lanes, audit rows and outbox rows), bound to it here. The binding is a
-- table that only its owner (the migrator) may write: a worker cannot
-- widen it, as it could a setting its session may SET.
--
-- consumer is a function's name (the consumer column of kfn's tables), or
-- '*' for every function: the operator's role, the relay's and a role
-- shared by all the workers of an installation. A role with no row sees no
-- row of kfn's consumer tables. The owner of the tables, superusers and
-- roles with BYPASSRLS are not subject to the policies.
CREATE TABLE kfn.function_roles (
    role_name  name        NOT NULL,
    consumer   text        NOT NULL,
    bound_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (role_name, consumer)
);

-- The migrator's default privileges may have granted the workers' role
-- DML on this table as it was created: take back every right but SELECT,
-- and let row-level security refuse any write by another role than the
-- owner, even one granted later by mistake.
DO $$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN SELECT DISTINCT g.grantee FROM information_schema.role_table_grants g
                    WHERE g.table_schema = 'kfn' AND g.table_name = 'function_roles'
                      AND g.grantee NOT IN (current_user, 'PUBLIC')
    LOOP
        EXECUTE format('REVOKE INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER ON kfn.function_roles FROM %I', grantee);
    END LOOP;
END;
$$;
GRANT SELECT ON kfn.function_roles TO PUBLIC;
ALTER TABLE kfn.function_roles ENABLE ROW LEVEL SECURITY;
CREATE POLICY read_bindings ON kfn.function_roles FOR SELECT USING (true);

-- The consumers the current role is bound to, for kfn's own checks (a
-- worker checks its bindings at start). It runs as the caller (not
-- SECURITY DEFINER): current_user is the role of the statement.
CREATE FUNCTION kfn.bound_consumers() RETURNS text[]
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT coalesce(array_agg(consumer), '{}') FROM kfn.function_roles WHERE role_name = current_user
$$;

-- One policy per table, for every command: a row is visible, and may be
-- written, only when its consumer is one the role is bound to, or the role
-- is bound to '*'. A write of a row for another consumer fails with
-- "new row violates row-level security policy"; a read, UPDATE or DELETE
-- of one finds no row.
--
-- The bindings are read by an uncorrelated subquery, which Postgres runs
-- once per statement (an InitPlan), not once per row: the fenced cursor
-- UPDATE and the batch's inbox INSERT pay one lookup each and keep their
-- primary-key scans. It is written out in each policy rather than calling
-- kfn.bound_consumers(): a SQL function's body is planned again at every
-- statement that calls it, which cost a prepared statement about 60 µs
-- against about 12 µs for the subquery.
CREATE POLICY function_rows ON kfn.cursors USING (
    (SELECT coalesce(array_agg(f.consumer), '{}') FROM kfn.function_roles f WHERE f.role_name = current_user) && ARRAY[consumer, '*']);
CREATE POLICY function_rows ON kfn.inbox USING (
    (SELECT coalesce(array_agg(f.consumer), '{}') FROM kfn.function_roles f WHERE f.role_name = current_user) && ARRAY[consumer, '*']);
CREATE POLICY function_rows ON kfn.event_inbox USING (
    (SELECT coalesce(array_agg(f.consumer), '{}') FROM kfn.function_roles f WHERE f.role_name = current_user) && ARRAY[consumer, '*']);
CREATE POLICY function_rows ON kfn.dead_letters USING (
    (SELECT coalesce(array_agg(f.consumer), '{}') FROM kfn.function_roles f WHERE f.role_name = current_user) && ARRAY[consumer, '*']);
CREATE POLICY function_rows ON kfn.parked_keys USING (
    (SELECT coalesce(array_agg(f.consumer), '{}') FROM kfn.function_roles f WHERE f.role_name = current_user) && ARRAY[consumer, '*']);
CREATE POLICY function_rows ON kfn.subject_lanes USING (
    (SELECT coalesce(array_agg(f.consumer), '{}') FROM kfn.function_roles f WHERE f.role_name = current_user) && ARRAY[consumer, '*']);
CREATE POLICY function_rows ON kfn.audit_log USING (
    (SELECT coalesce(array_agg(f.consumer), '{}') FROM kfn.function_roles f WHERE f.role_name = current_user) && ARRAY[consumer, '*']);
-- A dead letter purge is audited in one row with no function (consumer
-- empty), by the operator's kfn dlq purge and by every worker's dead
-- letter retention, which under a function's role purges that function's
-- letters only. Such a role may append that row, and read none of them.
CREATE POLICY installation_purge ON kfn.audit_log FOR INSERT WITH CHECK (consumer = '' AND action = 'purge');
-- The outbox's consumer is its source column (outbox.Origin.Consumer).
CREATE POLICY function_rows ON kfn.outbox USING (
    (SELECT coalesce(array_agg(f.consumer), '{}') FROM kfn.function_roles f WHERE f.role_name = current_user) && ARRAY[source, '*']);

-- Rolling upgrade: every role other than the owner that may read or write
-- kfn.cursors now (the shared kfn_worker, kfn_operator, a relay's role) is
-- bound to every function, so it keeps working once the policies are on.
INSERT INTO kfn.function_roles (role_name, consumer)
SELECT r.rolname, '*'
  FROM pg_roles r
 WHERE r.rolname <> current_user AND NOT r.rolsuper AND NOT r.rolbypassrls
   AND r.rolname NOT LIKE 'pg\_%'
   AND has_table_privilege(r.oid, 'kfn.cursors', 'SELECT, INSERT, UPDATE, DELETE');

ALTER TABLE kfn.cursors       ENABLE ROW LEVEL SECURITY;
ALTER TABLE kfn.inbox         ENABLE ROW LEVEL SECURITY;
ALTER TABLE kfn.event_inbox   ENABLE ROW LEVEL SECURITY;
ALTER TABLE kfn.dead_letters  ENABLE ROW LEVEL SECURITY;
ALTER TABLE kfn.parked_keys   ENABLE ROW LEVEL SECURITY;
ALTER TABLE kfn.subject_lanes ENABLE ROW LEVEL SECURITY;
ALTER TABLE kfn.audit_log     ENABLE ROW LEVEL SECURITY;
ALTER TABLE kfn.outbox        ENABLE ROW LEVEL SECURITY;
