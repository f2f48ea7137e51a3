-- kfn:additive
-- (Nullable columns: older workers write dead letters as before and leave
-- retry marks to newer workers.)

-- `kfn dlq retry`: an operator marks dead letters for retry, and the worker
-- lane that owns each record's partition (or subject) applies it through
-- the function in a transaction of its own, under its own fence. That
-- transaction deletes the dead letter, only while it is still marked, before
-- it runs the handler: a letter is applied at most once, and a second retry
-- finds nothing. A retry that fails again keeps the letter, clears the mark,
-- counts the attempt and keeps the new error. Every request and outcome is
-- also in kfn.audit_log (dlq_retry_requested, dlq_retry_applied,
-- dlq_retry_failed).
ALTER TABLE kfn.dead_letters
    -- Set while a retry is pending: when it was asked for, by whom and why.
    -- The actor and reason stay after a failed retry, for the record.
    ADD COLUMN retry_requested_at timestamptz,
    ADD COLUMN retry_actor        text,
    ADD COLUMN retry_reason       text,
    -- The last retry that failed: when, and its error.
    ADD COLUMN last_retry_at      timestamptz,
    ADD COLUMN last_retry_error   text;

-- Workers look for pending retries every few seconds (and when notified on
-- kfn_dlq_retry): with no retry pending the index is empty.
CREATE INDEX dead_letters_retry_pending ON kfn.dead_letters (consumer, topic, partition, "offset")
    WHERE retry_requested_at IS NOT NULL;
