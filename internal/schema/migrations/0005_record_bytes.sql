-- kfn:breaks-before 5
-- (Drops kfn.dead_letters.headers and turns kfn.outbox.event_key into
-- bytea: an older worker's writes fail.)

-- A record's bytes are stored as bytes. Kafka keys, values and header names
-- and values may hold any byte (NUL, invalid UTF-8, the 0x00 that starts
-- every Confluent-framed key); a text or jsonb column refuses some of them,
-- and a refused insert must never stall a partition.

-- Dead letter headers become two parallel bytea arrays, in record order,
-- duplicates kept; a NULL element is a header with a null value. Rows written
-- before this migration stored a JSON array of {"key": text, "value": base64}
-- (Go's encoding of []byte), converted here.
ALTER TABLE kfn.dead_letters
    ADD COLUMN header_keys   bytea[],
    ADD COLUMN header_values bytea[],
    -- The full length of the value, and its SHA-256 when value holds only a
    -- prefix of it (an oversized record keeps the first 4 KiB).
    ADD COLUMN value_size    bigint,
    ADD COLUMN value_sha256  bytea,
    -- The whole record (key, value, headers) in kfn's raw record encoding
    -- (inbox.EncodeRaw), set only when the dead letter could not be written
    -- column by column; record_key, value and the header arrays are then NULL.
    ADD COLUMN raw           bytea;

UPDATE kfn.dead_letters d
   SET header_keys = coalesce((SELECT array_agg(convert_to(h->>'key', 'UTF8') ORDER BY n)
                                 FROM jsonb_array_elements(d.headers) WITH ORDINALITY AS e(h, n)), '{}'),
       header_values = coalesce((SELECT array_agg(decode(h->>'value', 'base64') ORDER BY n)
                                   FROM jsonb_array_elements(d.headers) WITH ORDINALITY AS e(h, n)), '{}')
 WHERE jsonb_typeof(d.headers) = 'array';
UPDATE kfn.dead_letters SET value_size = length(value) WHERE value IS NOT NULL;

ALTER TABLE kfn.dead_letters
    DROP COLUMN headers,
    ADD CONSTRAINT dead_letters_headers_paired
        CHECK (coalesce(cardinality(header_keys), -1) = coalesce(cardinality(header_values), -1));

-- An outbox event key is bytes too: it defaults to the source record's key.
-- Keys stored so far were valid text, so their UTF-8 bytes are the bytes the
-- function had.
ALTER TABLE kfn.outbox ALTER COLUMN event_key TYPE bytea USING convert_to(event_key, 'UTF8');

-- kfn.outbox.headers stays jsonb: kfn puts there only text it has checked
-- (headers a function set, a traceparent and tracestate that passed W3C
-- Trace Context validation).
