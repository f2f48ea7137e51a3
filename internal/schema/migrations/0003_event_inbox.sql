-- kfn:additive
-- (A new table, used only by NATS-triggered functions of newer workers.)

-- Events a NATS-triggered function has handled, keyed by event id (the
-- Nats-Msg-Id the relay published them with). A redelivered or republished
-- event finds its row and is skipped. Dead-lettered events are recorded too,
-- so a redelivery does not apply them behind the operator's back.
CREATE TABLE kfn.event_inbox (
    consumer     text        NOT NULL,
    event_id     text        NOT NULL,
    subject      text        NOT NULL,
    stream_seq   bigint      NOT NULL,
    epoch        bigint      NOT NULL,
    outcome      text        NOT NULL DEFAULT 'applied' CHECK (outcome IN ('applied', 'dead_lettered')),
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);
CREATE INDEX event_inbox_processed_at ON kfn.event_inbox (processed_at);
