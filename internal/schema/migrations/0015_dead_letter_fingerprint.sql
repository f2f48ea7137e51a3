-- kfn:additive
-- (A column the database fills itself, by a trigger: workers built before it
-- insert dead letters as they did and get the fingerprint all the same.)

-- A dead letter's error fingerprint: its error text with UUIDs replaced by
-- <id> and every word that is a number or a hex string with a digit (an
-- offset, an order number, a hash) replaced by <n>, so that "order 4411 not
-- found" and "order 9 not found" fall into one group on the console's dead
-- letters page. The rule is this function and nothing else: kfn's Go code
-- never computes a fingerprint, it reads the column.
CREATE FUNCTION kfn.error_fingerprint(error text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT SET search_path = pg_catalog AS $$
    SELECT regexp_replace(regexp_replace(error,
        '[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}', '<id>', 'g'),
        '\m[0-9a-fA-F]*[0-9][0-9a-fA-F]*\M', '<n>', 'g')
$$;

-- Stored when the letter is written, and again when a failed retry
-- rewrites its error: grouping 100,000 letters by the fingerprint computed
-- at query time took 1.27 s, most of it in the regular expressions.
ALTER TABLE kfn.dead_letters ADD COLUMN error_fingerprint text;

CREATE FUNCTION kfn.set_error_fingerprint() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog AS $$
BEGIN
    NEW.error_fingerprint := kfn.error_fingerprint(NEW.error);
    RETURN NEW;
END
$$;

CREATE TRIGGER dead_letters_error_fingerprint
    BEFORE INSERT OR UPDATE OF error ON kfn.dead_letters
    FOR EACH ROW EXECUTE FUNCTION kfn.set_error_fingerprint();

-- The letters already there. (The migration holds the table's lock until
-- it commits: about 2 s per 100,000 letters on a 2-core machine, during
-- which a worker that dead-letters or retries a record waits;
-- BenchmarkMigration15.)
UPDATE kfn.dead_letters SET error_fingerprint = kfn.error_fingerprint(error);

-- A group's letters, and its newest letter, by index. The fingerprint is
-- indexed by its hash: an error text can be longer than a B-tree entry
-- may be.
CREATE INDEX dead_letters_group ON kfn.dead_letters (consumer, reason, md5(error_fingerprint), dead_at, id);
