package query

import "fmt"

// PublishStatements write a Publish call: every message of it in one
// statement, with or without the NOTIFY (see the notify limiter in the
// Publisher); PublishOne and PublishOneQuiet write a single message with
// VALUES-like parameters.
type PublishStatements struct {
	Publish           string
	PublishPlain      string
	PublishQuiet      string
	PublishPlainQuiet string
	PublishOne        string
	PublishOneQuiet   string
}

func buildPublish(n Names) PublishStatements {
	p := publishStatements(n)
	if n.Arrivals {
		// Plain messages arrive without a lookup (arrivals.go); the rest
		// (scheduled, keyed, PublishWithResult) go to the outbox.
		p = arrivalsPublish(n, p)
	}
	return p
}

func publishStatements(n Names) PublishStatements {
	return PublishStatements{
		// Publish inserts a whole Publish call in one statement: the messages
		// travel as parallel arrays, unnest turns them back into rows, in call
		// order (ORDER BY ord), so ids follow the order of the slice. Each
		// message becomes one row per consumer group bound to the topic
		// (publishGroups), still one statement whatever their number.
		//
		// A duration delay ($5, microseconds) is applied with the database
		// clock; an absolute time ($6) is stored as given, and one in the past
		// means "now" so it does not jump the queue. Both (Watermill's delay
		// keys): the duration while it lands within a second of the time,
		// else the time. ON CONFLICT skips a message
		// whose (topic, group, dedup_key) is already present.
		//
		// NOTIFY rides on the same statement, once per call, and only if a
		// row was inserted (a skipped duplicate wakes nobody). If a row is due
		// now the payload is the topic: idle loops of that topic claim at
		// once. If all rows are scheduled for later, the payload is the topic
		// behind ScheduleMark: loops do not claim, they only ask when the
		// next row is due (query NextDue) and shorten their sleep. NOTIFY is
		// transactional: it fires at commit and vanishes on rollback.
		Publish: fmt.Sprintf(`
WITH ins AS (%[1]s
    RETURNING id, uuid, available_at <= now() AS due
), woken AS (
    SELECT pg_notify($9, CASE WHEN bool_or(due) THEN $1 ELSE %[2]s || $1 END)
      FROM ins HAVING count(*) > 0
)
SELECT id, uuid, (SELECT count(*) FROM woken) FROM ins`, fullInsert(n), "chr(31)"),

		// PublishPlain is Publish for the common call: no message scheduled
		// or keyed. Without ON CONFLICT, the schedule arrays and the RETURNED
		// rows it costs the server and the client less (tests/bench). Every
		// row is due, so it always notifies. The function scan of unnest
		// feeds the INSERT in array order, so each group's ids follow the
		// call order (Watermill's ordering test publishes 1000 messages in
		// one call).
		PublishPlain: fmt.Sprintf(`
WITH ins AS (%s
    RETURNING 1
)
SELECT pg_notify($5, $1) WHERE EXISTS (SELECT 1 FROM ins)`, plainInsert(n)),

		// Quiet variants: the same rows, no NOTIFY. Most publishing
		// transactions use them: a transaction that NOTIFYs takes a
		// database-wide lock at commit (notifications enter the queue in
		// commit order), which serializes concurrent publishing commits.
		PublishQuiet:      fullInsert(n) + "\nRETURNING id, uuid, 0::bigint",
		PublishPlainQuiet: plainInsert(n),
		// One message, the commonest call: VALUES-like parameters cost the
		// client and the server less than arrays.
		PublishOne: fmt.Sprintf(`
WITH ins AS (%s
    RETURNING 1
)
SELECT pg_notify($5, $1) WHERE EXISTS (SELECT 1 FROM ins)`, oneInsert(n)),
		PublishOneQuiet: oneInsert(n),
	}
}

// publishGroups is the consumer groups a message of topic $1 gets a row
// for: every group bound to the topic, or the default group ” when none
// is, so a message published before any binding is kept (for subscribers
// without a group). One probe of the bindings' primary key: the left join
// of a single row yields the bound groups, or one row without a group.
// (Written as a union of the bound groups and a NOT EXISTS branch, the
// lookup took two probes and cost the server about 45 µs per statement, a
// fifth of a one-message transaction's work; this shape about 20 µs:
// tests/bench -publish-cost.)
func publishGroups(n Names) string {
	return fmt.Sprintf(`(SELECT coalesce(b.consumer_group, '') FROM (SELECT) AS one
                   LEFT JOIN %[1]s b ON b.topic = $1) AS g(consumer_group)`, n.QBindings)
}

func fullInsert(n Names) string {
	genCol, genVal := n.generationColumn("m.dedup_key")
	return fmt.Sprintf(`
    INSERT INTO %[1]s (topic, consumer_group, uuid, payload, metadata, available_at, dedup_key, ordering_key%[3]s)
    SELECT $1, g.consumer_group, m.uuid, m.payload, m.metadata::jsonb,
           CASE WHEN m.delay_us IS NOT NULL AND m.at IS NOT NULL
                THEN CASE WHEN now() + m.delay_us * interval '1 microsecond' BETWEEN m.at - interval '1 second' AND m.at + interval '2 seconds'
                          THEN now() + m.delay_us * interval '1 microsecond'
                          ELSE greatest(m.at, now()) END
                WHEN m.delay_us IS NOT NULL THEN now() + m.delay_us * interval '1 microsecond'
                WHEN m.at IS NOT NULL THEN greatest(m.at, now())
                ELSE now() END,
           m.dedup_key, m.ordering_key%[4]s
      FROM unnest($2::text[], $3::bytea[], $4::text[], $5::bigint[], $6::timestamptz[], $7::text[], $8::text[])
           WITH ORDINALITY AS m(uuid, payload, metadata, delay_us, at, dedup_key, ordering_key, ord)
     CROSS JOIN %[2]s
     ORDER BY m.ord, g.consumer_group
        ON CONFLICT %[5]s DO NOTHING`, n.QTable, publishGroups(n), genCol, genVal, n.dedupConflict())
}

func plainInsert(n Names) string {
	return fmt.Sprintf(`
    INSERT INTO %[1]s (topic, consumer_group, uuid, payload, metadata)
    SELECT $1, g.consumer_group, m.uuid, m.payload, m.metadata::jsonb
      FROM unnest($2::text[], $3::bytea[], $4::text[]) AS m(uuid, payload, metadata)
     CROSS JOIN %[2]s`, n.QTable, publishGroups(n))
}

func oneInsert(n Names) string {
	return fmt.Sprintf(`
    INSERT INTO %[1]s (topic, consumer_group, uuid, payload, metadata)
    SELECT $1, g.consumer_group, $2, $3, $4::jsonb FROM %[2]s`, n.QTable, publishGroups(n))
}
