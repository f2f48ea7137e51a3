-- kfn:additive
-- (A new table that workers built before it never read or write; but they
-- do not check the lane count either, so --lanes above 1 waits until every
-- worker of the function is built with it.)

-- Lanes of NATS-triggered functions: a function's events on a subject are
-- spread over `lanes` lanes by a hash of their key (outbox.LaneOf), each
-- lane with its own lease and its own cursor row (kfn.cursors, partition =
-- lane). The event inbox stays keyed by (consumer, event_id) across lanes,
-- so an event moved to another lane by a change of the count is still
-- applied once.
--
-- No row means one lane. A worker configured with another count changes it
-- in its lane claim (inbox.ClaimLane), which fences every lane of the old
-- count and starts the new lanes where the slowest old lane stood; a worker
-- started before changed_at with the old count is refused.
CREATE TABLE kfn.subject_lanes (
    consumer   text        NOT NULL,
    subject    text        NOT NULL,
    lanes      integer     NOT NULL CHECK (lanes >= 1),
    changed_at timestamptz NOT NULL,
    changed_by text        NOT NULL DEFAULT '',
    PRIMARY KEY (consumer, subject)
);
