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
// lookups), in DeadLetterColumns order.
func UIDeadLettersByID(n Names) string {
	return fmt.Sprintf(`SELECT %s FROM %s WHERE id = ANY ($1::bigint[]) ORDER BY failed_at, id`, DeadLetterColumns, n.QDLQ)
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
// last error, rows behind the head (counted up to 10,000). It reads the
// group's keyed rows through the ordering-key index, never the table.
func UIBlockedKeys(n Names) string {
	return fmt.Sprintf(`SELECT h.ordering_key, h.id, h.deliveries, h.available_at,
       h.lease_token IS NOT NULL AND h.leased_until >= now(), coalesce(h.last_error, ''),
       (SELECT count(*) FROM (SELECT 1 FROM %[1]s w
          WHERE w.topic = $1 AND w.consumer_group = $2 AND w.ordering_key = h.ordering_key
            AND w.id > h.id AND w.available_at < 'infinity' LIMIT 10000) b)
  FROM %[1]s h
 WHERE h.topic = $1 AND h.consumer_group = $2 AND h.ordering_key IS NOT NULL
   AND h.deliveries >= $3 AND h.available_at < 'infinity'
   AND NOT EXISTS (SELECT 1 FROM %[1]s k
        WHERE k.topic = $1 AND k.consumer_group = $2 AND k.ordering_key = h.ordering_key
          AND k.id < h.id AND k.available_at < 'infinity')
 ORDER BY h.deliveries DESC, h.id
 LIMIT $4`, n.QTable)
}

// UITableCounters reads the rows inserted and deleted in table $1 (a
// quoted, qualified name) since the statistics were reset, from the
// cumulative statistics (no table access; reported by every backend at
// the end of its transactions, within about a second).
const UITableCounters = `SELECT coalesce(sum(n_tup_ins), 0)::bigint, coalesce(sum(n_tup_del), 0)::bigint
  FROM pg_catalog.pg_stat_user_tables WHERE relid = to_regclass($1)`
