-- kfn:breaks-before 4
-- (Lease groups become scoped by installation: an older worker would take
-- leases under other keys than newer workers, for the same partitions.)

-- The identity of this kfn installation (one database). Lease groups in NATS
-- are scoped by it, so installations sharing a NATS server never contend for
-- each other's partitions or relay shards.
CREATE TABLE kfn.installation (
    id         uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO kfn.installation DEFAULT VALUES;
