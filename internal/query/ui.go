package query

import "fmt"

// Statements of the operator web page (pkg/pgoutbox/pgoutboxui) beyond
// those of the operator functions. TestUIStatementsUseIndexes EXPLAINs
// each on a large outbox.

// UIBindings lists every binding: (topic, consumer_group), a scan of the
// small bindings table.
func UIBindings(n Names) string {
	return fmt.Sprintf(`SELECT topic, consumer_group FROM %s ORDER BY 1, 2`, n.QBindings)
}

// UIDeadLettersByID reads the dead letters with ids $1 (primary-key
// lookups), in DeadLetterColumns order, the first $2 bytes of each
// payload.
func UIDeadLettersByID(n Names) string {
	return fmt.Sprintf(`SELECT %s FROM %s WHERE id = ANY ($1::bigint[]) ORDER BY failed_at, id`, DeadLetterColumns("$2"), n.QDLQ)
}

// UICountDeadLetters counts the dead letters DeadLetterWhere matches
// ($1..$7), for the confirmation of a requeue or purge.
func UICountDeadLetters(n Names, topic bool) string {
	tc := ""
	if topic {
		tc = " AND topic = $1"
	}
	return fmt.Sprintf(`SELECT count(*) FROM %s WHERE %s%s`, n.QDLQ, DeadLetterWhere, tc)
}

// UIBlockedKeys lists up to $4 ordering keys of topic $1 and group $2 whose
// head (the key's oldest row, parked rows aside) has been delivered $3
// times or more: a key stuck on a failing message holds back every row
// behind it. Columns: key, head id, deliveries, available_at, leased now,
// last error, rows behind the head (counted up to BlockedBehindCap).
//
// A head that failed waits for its retry (scheduled) or is being retried
// (leased), so the candidates are the group's first scheduled rows, leased
// rows and ready rows, each a bounded range scan of its partial index
// (BlockedScan rows each): the cost does not grow with the backlog (every
// keyed row checked for being a head read 16,667 heap rows of one group
// of a 1,000,000-row outbox, 0.5 s). A head beyond those ranges is missed.
func UIBlockedKeys(n Names) string {
	return fmt.Sprintf(`WITH cand AS (
    (SELECT id, ordering_key, deliveries, available_at, false AS leased, last_error FROM %[1]s
      WHERE topic = $1 AND consumer_group = $2 AND lease_token IS NULL AND available_at > now() AND available_at < 'infinity'
      ORDER BY available_at, id LIMIT %[2]d)
    UNION ALL
    (SELECT id, ordering_key, deliveries, available_at, leased_until >= now(), last_error FROM %[1]s
      WHERE topic = $1 AND consumer_group = $2 AND lease_token IS NOT NULL
      ORDER BY leased_until LIMIT %[2]d)
    UNION ALL
    (SELECT id, ordering_key, deliveries, available_at, false, last_error FROM %[1]s
      WHERE topic = $1 AND consumer_group = $2 AND lease_token IS NULL AND available_at <= now()
      ORDER BY available_at, id LIMIT %[2]d)
)
SELECT h.ordering_key, h.id, h.deliveries, h.available_at, h.leased, coalesce(h.last_error, ''),
       (SELECT count(*) FROM (SELECT 1 FROM %[1]s w
          WHERE w.topic = $1 AND w.consumer_group = $2 AND w.ordering_key = h.ordering_key
            AND w.id > h.id LIMIT %[3]d) b)
  FROM cand h
 WHERE h.ordering_key IS NOT NULL AND h.deliveries >= $3
   AND NOT EXISTS (SELECT 1 FROM %[1]s k
        WHERE k.topic = $1 AND k.consumer_group = $2 AND k.ordering_key = h.ordering_key
          AND `+olderOfKey("k", "h.ordering_key", "h.id")+` AND k.available_at < 'infinity'
        OFFSET 0)
 ORDER BY h.deliveries DESC, h.id
 LIMIT $4`, n.QTable, BlockedScan, BlockedBehindCap)
}

// BlockedScan bounds each candidate range of UIBlockedKeys;
// BlockedBehindCap bounds the count of rows behind a blocked head.
const (
	BlockedScan      = 1000
	BlockedBehindCap = 1000
)

// UITableCounters reads the rows inserted and deleted in table $1 (a
// quoted, qualified name) since the statistics were reset, from the
// cumulative statistics (no table access; reported by every backend at
// the end of its transactions, within about a second). A partitioned
// table (a rotating outbox) counts nothing itself: its partitions' counts
// are summed, found in pg_inherits (pg_partition_tree would lock each
// one, and wait behind an exclusive lock on it). A row the rotation moves out of the ring counts as a delete
// and an insert; a TRUNCATE, as neither.
const UITableCounters = `WITH RECURSIVE tree(relid) AS (
    SELECT to_regclass($1::text)::oid
     UNION ALL
    SELECT i.inhrelid FROM pg_catalog.pg_inherits i JOIN tree ON i.inhparent = tree.relid
)
SELECT coalesce(sum(pg_stat_get_tuples_inserted(relid)), 0)::bigint, coalesce(sum(pg_stat_get_tuples_deleted(relid)), 0)::bigint
  FROM tree
 WHERE relid IS NOT NULL`
