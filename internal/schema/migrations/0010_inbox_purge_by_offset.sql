-- kfn:additive
-- (Drops an index only workers' retention read: an older worker still
-- purges correctly, but its purge query scans kfn.inbox without it, so
-- finish the rolling upgrade before the inbox grows large.)

-- Retention purges each partition's inbox rows in offset order, through the
-- primary key (inbox.Purge), so the index on processed_at has no reader
-- left. It cost every handled record one more index insert (about a sixth
-- of the inbox's WAL) in the batch transaction.
DROP INDEX kfn.inbox_processed_at;
