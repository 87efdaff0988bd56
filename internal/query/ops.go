package query

import "fmt"

// Operator statements: queue statistics, dead-letter listing, requeue and
// purge, parked-row requeue, peek. They are built on demand (operators call
// them rarely) rather than stored in Queries.

// statsColumns are the Stats result columns, computed from the aggregates
// ready, scheduled, parked, oldest (the oldest due unleased row), leased
// and expired of relation k (with topic, consumer_group).
const statsColumns = `k.topic, k.consumer_group, coalesce(ready, 0), coalesce(scheduled, 0), coalesce(parked, 0),
       coalesce(extract(epoch FROM (SELECT at FROM clock) - oldest) * 1000000, 0)::bigint, coalesce(leased, 0), coalesce(expired, 0)`

// boundColumn is the last Stats column: whether the pair is bound (a
// primary-key probe of the bindings).
func boundColumn(n Names) string {
	return fmt.Sprintf(`EXISTS (SELECT 1 FROM %s b WHERE b.topic = k.topic AND b.consumer_group = k.consumer_group)`, n.QBindings)
}

const unleasedAggs = `count(*) FILTER (WHERE available_at <= (SELECT at FROM clock)) AS ready,
           count(*) FILTER (WHERE available_at > (SELECT at FROM clock) AND available_at < 'infinity') AS scheduled,
           count(*) FILTER (WHERE available_at = 'infinity') AS parked,
           min(available_at) FILTER (WHERE available_at <= (SELECT at FROM clock)) AS oldest`

const leasedAggs = `count(*) FILTER (WHERE leased_until >= (SELECT at FROM clock)) AS leased,
           count(*) FILTER (WHERE leased_until < (SELECT at FROM clock)) AS expired`

// statsClock is the time Stats counts by: the clock once the statement
// runs, after its snapshot was taken. now() is when its transaction
// began: a message published (available_at = its own transaction's
// now()) by a transaction that began after it and committed before the
// snapshot counted as scheduled, a few on every busy topic.
const statsClock = `clock AS MATERIALIZED (SELECT clock_timestamp() AS at)`

// Stats returns the statistics statement: for every (topic, consumer
// group) when topic is false; for the groups of topic $1 when topic is true
// and group false; for group $2 of topic $1 when both are true. Bound groups
// without rows report zeros (a gauge goes to 0 rather than vanishing).
//
// Shape (measured on 1,000,000 rows, 60 pairs, visibility map empty, see
// BenchmarkStats): with a topic, each lease state is one range scan of its
// partial index, grouped by consumer group (TestStatsUsesIndexes pins it).
// For every topic, one pass over the table is cheapest: counting every row
// through the indexes visits each heap page once per pair (a loose index
// scan over the pairs plus per-pair range scans took 4.2 s, this one pass
// 0.32 s).
func Stats(n Names, topic, group bool) string {
	t := n.QTable
	if !topic {
		return fmt.Sprintf(`WITH `+statsClock+`, c AS (
    SELECT topic, consumer_group,
           count(*) FILTER (WHERE lease_token IS NULL AND available_at <= (SELECT at FROM clock)) AS ready,
           count(*) FILTER (WHERE lease_token IS NULL AND available_at > (SELECT at FROM clock) AND available_at < 'infinity') AS scheduled,
           count(*) FILTER (WHERE lease_token IS NULL AND available_at = 'infinity') AS parked,
           min(available_at) FILTER (WHERE lease_token IS NULL AND available_at <= (SELECT at FROM clock)) AS oldest,
           count(*) FILTER (WHERE lease_token IS NOT NULL AND leased_until >= (SELECT at FROM clock)) AS leased,
           count(*) FILTER (WHERE lease_token IS NOT NULL AND leased_until < (SELECT at FROM clock)) AS expired
      FROM %[1]s GROUP BY topic, consumer_group
), k AS (
    SELECT topic, consumer_group FROM %[2]s UNION SELECT topic, consumer_group FROM c
)
SELECT %[3]s, %[4]s
  FROM k LEFT JOIN c ON c.topic = k.topic AND c.consumer_group = k.consumer_group
 ORDER BY 1, 2`, t, n.QBindings, statsColumns, boundColumn(n))
	}
	cond, pair := "topic = $1", ""
	if group {
		cond += " AND consumer_group = $2"
		pair = " UNION SELECT $1, $2"
	}
	return fmt.Sprintf(`WITH `+statsClock+`, u AS (
    SELECT topic, consumer_group, %[4]s
      FROM %[1]s WHERE %[3]s AND lease_token IS NULL GROUP BY topic, consumer_group
), l AS (
    SELECT topic, consumer_group, %[5]s
      FROM %[1]s WHERE %[3]s AND lease_token IS NOT NULL GROUP BY topic, consumer_group
), k AS (
    SELECT topic, consumer_group FROM %[2]s WHERE %[3]s
    UNION SELECT topic, consumer_group FROM u
    UNION SELECT topic, consumer_group FROM l%[6]s
)
SELECT %[7]s, %[8]s
  FROM k LEFT JOIN u ON u.topic = k.topic AND u.consumer_group = k.consumer_group
         LEFT JOIN l ON l.topic = k.topic AND l.consumer_group = k.consumer_group
 ORDER BY 1, 2`, t, n.QBindings, cond, unleasedAggs, leasedAggs, pair, statsColumns, boundColumn(n))
}

// DLQStats counts dead letters per topic, group and reason, optionally of
// topic $1 (the (topic, failed_at) index) and group $2.
func DLQStats(n Names, topic, group bool) string {
	where := ""
	switch {
	case topic && group:
		where = "WHERE topic = $1 AND consumer_group = $2"
	case topic:
		where = "WHERE topic = $1"
	}
	return fmt.Sprintf(`SELECT topic, consumer_group, failure_reason, count(*) FROM %s %s GROUP BY 1, 2, 3 ORDER BY 1, 2, 3`, n.QDLQ, where)
}

// DeadLetterColumns are the columns DeadLetters reads, in scan order, the
// payload as PayloadPrefix reads it by prefix (a parameter, or 0 for the
// whole payload), then its size.
func DeadLetterColumns(prefix string) string {
	return `id, topic, consumer_group, uuid, ` + PayloadPrefix("payload", prefix) + `, octet_length(payload), metadata::text, created_at, deliveries,
       dedup_key, last_error, failure_reason, failed_by, failed_at, ordering_key`
}

// PayloadPrefix reads the first prefix bytes of the payload column col
// when prefix is above 0, else all of it. A stored payload is read no
// further than that when it is stored uncompressed or compressed with
// pglz (PostgreSQL fetches a slice of an out-of-line value); an lz4 one is
// decompressed whole on the server, and only the prefix sent. Either way a
// list of large messages that shows a preview does not send megabytes;
// octet_length reads only the value's header.
func PayloadPrefix(col, prefix string) string {
	if prefix == "0" {
		return col
	}
	return fmt.Sprintf("CASE WHEN %[2]s::int > 0 THEN substring(%[1]s from 1 for %[2]s::int) ELSE %[1]s END", col, prefix)
}

// DeadLetterWhere is the filter of DeadLetters and of the requeue by
// filter. NULL parameters match everything: $1 topic, $2 group, $3 reason,
// $4 failed at or after, $5 failed before, ($6, $7) keyset cursor (failed_at,
// id). With a topic, the (topic, failed_at) index serves the range.
const DeadLetterWhere = `($1::text IS NULL OR topic = $1)
   AND ($2::text IS NULL OR consumer_group = $2)
   AND ($3::text IS NULL OR failure_reason = $3)
   AND ($4::timestamptz IS NULL OR failed_at >= $4)
   AND ($5::timestamptz IS NULL OR failed_at < $5)
   AND ($6::timestamptz IS NULL OR (failed_at, id) > ($6, $7::bigint))`

// DeadLetters lists dead letters in (failed_at, id) order, $8 rows at most,
// the first $9 bytes of each payload (0: all).
// The topic filter is spelled out when given, so that a prepared (generic)
// plan still reads the (topic, failed_at) index.
func DeadLetters(n Names, topic bool) string {
	tc := ""
	if topic {
		tc = " AND topic = $1"
	}
	return fmt.Sprintf(`SELECT %s FROM %s WHERE %s%s ORDER BY failed_at, id LIMIT $8`, DeadLetterColumns("$9"), n.QDLQ, DeadLetterWhere, tc)
}

// requeueFrom moves the dead letters chosen by sel (a SELECT of ids) back
// into the outbox in one statement: each keeps its id (so a row's history
// reads the same in both tables, and a second requeue of the same row
// fails on the primary key rather than duplicating it), uuid, payload,
// metadata, group, dedup key, ordering key and created_at; it is due at once, with its
// delivery count and failure fields cleared. A dead letter whose dedup key
// is held by a row in the outbox (or by an earlier one of the same batch),
// or whose id is (an outbox recreated since), is not inserted (ON CONFLICT
// DO NOTHING, any unique index) and therefore not deleted: it stays a dead
// letter. Only inserted rows are deleted. One NOTIFY per topic
// wakes idle subscribers ($N: the channel).
func requeueFrom(n Names, sel, channelParam string) string {
	genCol, genVal := n.generationColumn("d.dedup_key")
	// A rotating outbox's primary key holds the generation: an id alive
	// in another partition would not conflict.
	sameID := ""
	if n.Rotating {
		sameID = fmt.Sprintf("\n     WHERE NOT EXISTS (SELECT 1 FROM %s o WHERE o.id = d.id)", n.QTable)
	}
	return fmt.Sprintf(`WITH sel AS (%[3]s
), ins AS (
    INSERT INTO %[1]s (id, topic, consumer_group, uuid, payload, metadata, created_at, available_at, deliveries, dedup_key, ordering_key%[5]s)
    OVERRIDING SYSTEM VALUE
    SELECT d.id, d.topic, d.consumer_group, d.uuid, d.payload, d.metadata, d.created_at, now(), 0, d.dedup_key, d.ordering_key%[6]s
      FROM %[2]s d JOIN sel ON sel.id = d.id%[7]s
     ORDER BY d.failed_at, d.id
        ON CONFLICT DO NOTHING
    RETURNING id, topic
), del AS (
    DELETE FROM %[2]s WHERE id IN (SELECT id FROM ins) RETURNING id
), woken AS (
    SELECT pg_notify(%[4]s, topic) FROM (SELECT DISTINCT topic FROM ins) t
)
SELECT (SELECT count(*) FROM del), (SELECT count(*) FROM woken)`, n.QTable, n.QDLQ, sel, channelParam, genCol, genVal, sameID)
}

// RequeueDeadLetterIDs requeues the dead letters with ids $1; $2 is the
// notification channel.
func RequeueDeadLetterIDs(n Names) string {
	return requeueFrom(n, fmt.Sprintf(`SELECT id FROM %s WHERE id = ANY ($1::bigint[]) FOR UPDATE`, n.QDLQ), "$2")
}

// RequeueDeadLetterFilter requeues the dead letters DeadLetterWhere
// matches, at most $8 (NULL: all) in (failed_at, id) order; $9 is the
// channel. It passes over those whose dedup key a row of the outbox holds
// (they would stay): taken into the limit, they would fill every batch of
// a caller that requeues until a call moves nothing, and end it early.
func RequeueDeadLetterFilter(n Names, topic bool) string {
	tc := ""
	if topic {
		tc = " AND topic = $1"
	}
	return requeueFrom(n, fmt.Sprintf(`SELECT id FROM %s d0 WHERE %s%s
       AND (d0.dedup_key IS NULL OR NOT EXISTS (SELECT 1 FROM %s o
            WHERE o.topic = d0.topic AND o.consumer_group = d0.consumer_group AND o.dedup_key = d0.dedup_key))
     ORDER BY failed_at, id LIMIT $8 FOR UPDATE OF d0`, n.QDLQ, DeadLetterWhere, tc, n.QTable), "$9")
}

// PurgeDeadLetters deletes at most $2 dead letters that failed before $1.
// The dead-letter index is (topic, failed_at): a loose index scan finds
// the topics (one probe each), and each topic's oldest rows are a range
// scan of the index, so no batch reads the whole table.
func PurgeDeadLetters(n Names) string {
	return fmt.Sprintf(`WITH RECURSIVE topics(topic) AS (
    (SELECT topic FROM %[1]s ORDER BY topic LIMIT 1)
    UNION ALL
    SELECT (SELECT topic FROM %[1]s WHERE topic > t.topic ORDER BY topic LIMIT 1)
      FROM topics t WHERE t.topic IS NOT NULL
), victims AS (
    SELECT v.id FROM topics t CROSS JOIN LATERAL (
        SELECT id FROM %[1]s WHERE topic = t.topic AND failed_at < $1 ORDER BY failed_at LIMIT $2) v
     WHERE t.topic IS NOT NULL
     LIMIT $2
)
DELETE FROM %[1]s WHERE id IN (SELECT id FROM victims)`, n.QDLQ)
}

// PurgeDeadLettersMatching deletes at most $2 dead letters that failed
// before $1 and match $3 topic, $4 group, $5 reason (NULL matches all),
// oldest first. The topic filter is spelled out when given, so the (topic,
// failed_at) index serves it.
func PurgeDeadLettersMatching(n Names, topic bool) string {
	tc := ""
	if topic {
		tc = " AND topic = $3"
	}
	return fmt.Sprintf(`DELETE FROM %[1]s WHERE id IN (
    SELECT id FROM %[1]s
     WHERE failed_at < $1
       AND ($3::text IS NULL OR topic = $3)
       AND ($4::text IS NULL OR consumer_group = $4)
       AND ($5::text IS NULL OR failure_reason = $5)%[2]s
     ORDER BY failed_at, id
     LIMIT $2)`, n.QDLQ, tc)
}

// DeadLetterTopics lists the topics of the dead letters with ids $1.
func DeadLetterTopics(n Names) string {
	return fmt.Sprintf(`SELECT DISTINCT topic FROM %s WHERE id = ANY ($1::bigint[]) ORDER BY 1`, n.QDLQ)
}

// DeleteDeadLetters deletes the dead letters with ids $1.
func DeleteDeadLetters(n Names) string {
	return fmt.Sprintf(`DELETE FROM %s WHERE id = ANY ($1::bigint[])`, n.QDLQ)
}

// DeadLetterByID reads one dead letter, DeadLetterColumns, by id $1.
func DeadLetterByID(n Names) string {
	return fmt.Sprintf(`SELECT %s FROM %s WHERE id = $1`, DeadLetterColumns("0"), n.QDLQ)
}

// RequeueParked makes parked rows (available_at = 'infinity', the outbox's
// dead letters without a dead-letter table) due again, clearing their
// delivery count and failure fields: $1 topic, $2 group, $3 reason (NULL
// matches all), $4 ids (NULL: any), $5 at most this many (NULL: all), $6 the
// channel. With a topic and group it is a range scan of the ready index at
// its far end.
func RequeueParked(n Names) string {
	return fmt.Sprintf(`WITH sel AS (
    SELECT id FROM %[1]s
     WHERE lease_token IS NULL AND available_at = 'infinity'
       AND ($1::text IS NULL OR topic = $1)
       AND ($2::text IS NULL OR consumer_group = $2)
       AND ($3::text IS NULL OR failure_reason = $3)
       AND ($4::bigint[] IS NULL OR id = ANY ($4))
     ORDER BY id
     LIMIT $5
       FOR UPDATE SKIP LOCKED
), upd AS (
    UPDATE %[1]s o
       SET available_at = now(), deliveries = 0, failure_reason = NULL, last_error = NULL
      FROM sel WHERE o.id = sel.id AND o.lease_token IS NULL AND o.available_at = 'infinity'
    RETURNING o.topic
), woken AS (
    SELECT pg_notify($6, topic) FROM (SELECT DISTINCT topic FROM upd) t
)
SELECT (SELECT count(*) FROM upd), (SELECT count(*) FROM woken)`, n.QTable)
}

// Peek reads up to $3 unleased rows of topic $1 and group $2 in delivery
// order (ready, then scheduled, then parked at 'infinity'), the first $4
// bytes of each payload (0: all), without locking or leasing them: a
// range scan of the ready index.
//
// With arrivals, the group's arrivals too (those its binding covers, the
// primary key's range from its start), each due at its arrival; for the
// default group while it is not bound, the arrivals no binding covers: the
// topic's unbound messages, which Stats counts as its.
func Peek(n Names) string {
	// A parked row's 'infinity' comes back as NULL: database/sql drivers
	// read it as text, or fail on it (bun's pgdriver).
	outbox := fmt.Sprintf(`SELECT id, uuid, %s, octet_length(payload), metadata::text, created_at,
       CASE WHEN available_at < 'infinity' THEN available_at END AS due, deliveries,
       dedup_key, last_error, failure_reason, ordering_key
  FROM %s
 WHERE topic = $1 AND consumer_group = $2 AND lease_token IS NULL
 ORDER BY available_at, id
 LIMIT $3`, PayloadPrefix("payload", "$4"), n.QTable)
	if !n.Arrivals {
		return outbox
	}
	// Two ranges of the primary key, each a walk from its bound, not one
	// with an OR the planner would read the topic's whole backlog for.
	arrivals := func(cond string) string {
		return fmt.Sprintf(`(SELECT a.id, a.uuid, %s, octet_length(a.payload), a.metadata::text, a.created_at, a.created_at, 0, NULL, NULL, NULL, NULL
  FROM %s a
 WHERE a.topic = $1 AND %s
 ORDER BY a.id
 LIMIT $3)`, PayloadPrefix("a.payload", "$4"), n.QArrivals, cond)
	}
	return fmt.Sprintf(`(%s)
UNION ALL
%s
UNION ALL
%s
ORDER BY 7, 1
LIMIT $3`, outbox,
		arrivals(fmt.Sprintf(`a.id >= (SELECT arrivals_from FROM %s WHERE topic = $1 AND consumer_group = $2)`, n.QBindings)),
		arrivals(fmt.Sprintf(`$2 = '' AND NOT EXISTS (SELECT 1 FROM %[1]s WHERE topic = $1 AND consumer_group = '')
   AND a.id < coalesce((SELECT min(arrivals_from) FROM %[1]s WHERE topic = $1), 9223372036854775807)`, n.QBindings)))
}
