package main

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// The publish cost breakdown (-publish-cost) answers "where does a
// Publish's time go" with figures that do not depend on how busy the
// machine is: for each step of the write path, the CPU time the server's
// backend spent (from /proc/<pid>/schedstat, so only for a server on this
// machine), the client's CPU time (getrusage), and the WAL bytes written,
// per transaction, next to the wall time. Each case removes or adds one
// thing against its neighbour, so the differences are the costs of the
// steps: the Publisher against its statement run directly, the bindings
// lookup, the NOTIFY, each index, the outbox's columns against a bare table
// holding the same payload, and watermill-sql's queue table.

// costCase is one step of the breakdown: a table (DDL run in a schema of
// its own, %s being that schema) and one transaction's work on it.
type costCase struct {
	name  string
	perTx int
	// setup creates the case's table in schema s.
	setup func(ctx context.Context, b *bench, s string) error
	// publish does one transaction's work (without BEGIN/COMMIT) in t.
	publish func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error
}

// outboxSetup creates the outbox with schema.Create and then drops the
// named indexes: what is left is the layout the case measures.
func outboxSetup(drop ...string) func(ctx context.Context, b *bench, s string) error {
	return func(ctx context.Context, b *bench, s string) error {
		if err := schema.Create(ctx, tx.FromPgxPool(b.pool), schema.Config{Schema: s, Table: "outbox"}); err != nil {
			return err
		}
		for _, idx := range drop {
			if _, err := b.pool.Exec(ctx, `DROP INDEX `+pgx.Identifier{s, idx}.Sanitize()); err != nil {
				return err
			}
		}
		return nil
	}
}

// arrivalsSetup creates an outbox with arrivals (schema.Config.Arrivals).
func arrivalsSetup(ctx context.Context, b *bench, s string) error {
	return schema.Create(ctx, tx.FromPgxPool(b.pool), schema.Config{Schema: s, Table: "outbox", Arrivals: true})
}

// arrivalsPublisherCost is publisherCost(0) on an outbox with arrivals.
func arrivalsPublisherCost(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
	pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(t), pgoutbox.PublisherConfig{Tables: schema.Config{Schema: s, Table: "outbox", Arrivals: true}}, nil)
	if err != nil {
		return err
	}
	return pub.Publish(topic, msgs...)
}

// collateC makes the outbox's text keys compare as bytes.
func collateC(setup func(ctx context.Context, b *bench, s string) error) func(ctx context.Context, b *bench, s string) error {
	return func(ctx context.Context, b *bench, s string) error {
		if err := setup(ctx, b, s); err != nil {
			return err
		}
		_, err := b.pool.Exec(ctx, `ALTER TABLE `+pgx.Identifier{s, "outbox"}.Sanitize()+`
    ALTER COLUMN topic TYPE text COLLATE "C", ALTER COLUMN consumer_group TYPE text COLLATE "C",
    ALTER COLUMN dedup_key TYPE text COLLATE "C", ALTER COLUMN ordering_key TYPE text COLLATE "C"`)
		return err
	}
}

func sqlSetup(ddl string) func(ctx context.Context, b *bench, s string) error {
	return func(ctx context.Context, b *bench, s string) error {
		_, err := b.pool.Exec(ctx, fmt.Sprintf(ddl, pgx.Identifier{s}.Sanitize()))
		return err
	}
}

// outboxQueries are the Publisher's statements for the outbox of schema s,
// built once per schema (as the Publisher caches them).
func outboxQueries(s string) *query.Queries {
	if q, ok := builtQueries[s]; ok {
		return q
	}
	n, err := query.NewNames(s, "outbox", "")
	if err != nil {
		panic(err)
	}
	builtQueries[s] = query.Build(n, false)
	return builtQueries[s]
}

var builtQueries = map[string]*query.Queries{} // the cases run one at a time

func publisherCost(cooldown time.Duration) func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
	return func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
		pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(t), pgoutbox.PublisherConfig{Tables: schema.Config{Schema: s, Table: "outbox"}, NotifyCooldown: cooldown}, nil)
		if err != nil {
			return err
		}
		return pub.Publish(topic, msgs...)
	}
}

// stmtCost runs one of the Publisher's statements directly, with the
// arguments the Publisher gives it ('{}' metadata).
func stmtCost(pick func(q *query.Queries) string, notify bool) func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
	return func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
		q := outboxQueries(s)
		sql := pick(q)
		var err error
		if len(msgs) == 1 {
			args := []any{topic, msgs[0].UUID, msgs[0].Payload, "{}"}
			if notify {
				args = append(args, q.Names.Channel)
			}
			_, err = t.Exec(ctx, sql, args...)
			return err
		}
		uuids, payloads, metadata := columns(msgs)
		args := []any{topic, uuids, payloads, metadata}
		if notify {
			args = append(args, q.Names.Channel)
		}
		_, err = t.Exec(ctx, sql, args...)
		return err
	}
}

func columns(msgs []*message.Message) ([]string, [][]byte, []string) {
	uuids := make([]string, len(msgs))
	payloads := make([][]byte, len(msgs))
	metadata := make([]string, len(msgs))
	for i, m := range msgs {
		uuids[i], payloads[i], metadata[i] = m.UUID, m.Payload, "{}"
	}
	return uuids, payloads, metadata
}

// valuesCost inserts with VALUES rows into table (of schema s), the columns
// given, one ($n...) tuple per message of (topic?, uuid, payload, metadata).
func valuesCost(table string, withTopic bool, cast string) func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
	return func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
		cols := "uuid, payload, metadata"
		if withTopic {
			cols = "topic, " + cols
		}
		var sb strings.Builder
		fmt.Fprintf(&sb, "INSERT INTO %s (%s) VALUES ", pgx.Identifier{s, table}.Sanitize(), cols)
		args := make([]any, 0, 4*len(msgs))
		for i, m := range msgs {
			if i > 0 {
				sb.WriteString(",")
			}
			sb.WriteString("(")
			if withTopic {
				args = append(args, topic)
				fmt.Fprintf(&sb, "$%d,", len(args))
			}
			args = append(args, m.UUID, m.Payload, "{}")
			fmt.Fprintf(&sb, "$%d,$%d,$%d::%s)", len(args)-2, len(args)-1, len(args), cast)
		}
		_, err := t.Exec(ctx, sb.String(), args...)
		return err
	}
}

// unnestCost inserts (topic, uuid, payload, metadata) from arrays into
// table: the shape of the Publisher's batch statement without the groups.
func unnestCost(table string) func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
	return func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
		uuids, payloads, metadata := columns(msgs)
		_, err := t.Exec(ctx, `INSERT INTO `+pgx.Identifier{s, table}.Sanitize()+` (topic, uuid, payload, metadata)
SELECT $1, m.uuid, m.payload, m.metadata::jsonb FROM unnest($2::text[], $3::bytea[], $4::text[]) AS m(uuid, payload, metadata)`,
			topic, uuids, payloads, metadata)
		return err
	}
}

// bareTable holds what a message is (topic, UUID, payload, metadata) and a
// primary key, nothing else: the floor of a table with the same payload.
const bareTable = `CREATE TABLE %s.bare (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic    text  NOT NULL,
    uuid     text  NOT NULL,
    payload  bytea NOT NULL,
    metadata jsonb NOT NULL DEFAULT '{}')`

// arrivalsTable is a table a plain message (due now, no keys) could
// arrive in: what a message is, when it was published, and one index that
// finds a topic's messages in order; its consumer group and delivery state
// would be given when a subscriber takes it.
const arrivalsTable = `CREATE TABLE %s.arrivals (
    id         bigint GENERATED ALWAYS AS IDENTITY,
    topic      text  NOT NULL,
    uuid       text  NOT NULL,
    payload    bytea NOT NULL,
    metadata   jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, id))`

// watermillQueueTable is watermill-sql's PostgreSQLQueueSchema table with a
// bytea payload (tests/bench/watermillsql.go).
const watermillQueueTable = `CREATE TABLE %s.queue (
    "offset"   SERIAL PRIMARY KEY,
    uuid       VARCHAR(36) NOT NULL,
    payload    BYTEA DEFAULT NULL,
    metadata   JSON DEFAULT NULL,
    acked      BOOLEAN NOT NULL DEFAULT FALSE,
    created_at TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT CURRENT_TIMESTAMP)`

func costCases() []costCase {
	n, err := query.NewNames("public", "outbox", "")
	if err != nil {
		panic(err)
	}
	partial := []string{n.LeaseIdx, n.DedupIdx, n.OrderIdx, n.OrderLeaseIdx}
	var cases []costCase
	for _, perTx := range []int{1, 100} {
		one := perTx == 1
		pickQuiet := func(q *query.Queries) string {
			if one {
				return q.PublishOneQuiet
			}
			return q.PublishPlainQuiet
		}
		pickNotify := func(q *query.Queries) string {
			if one {
				return q.PublishOne
			}
			return q.PublishPlain
		}
		cases = append(cases,
			costCase{name: "Publisher (default cooldown)", perTx: perTx, setup: outboxSetup(), publish: publisherCost(0)},
			costCase{name: "Publisher, Tables.Arrivals", perTx: perTx, setup: arrivalsSetup, publish: arrivalsPublisherCost},
			costCase{name: "Publisher, NOTIFY in every tx", perTx: perTx, setup: outboxSetup(), publish: publisherCost(pgoutbox.NotifyEveryPublish)},
			costCase{name: "its statement with NOTIFY", perTx: perTx, setup: outboxSetup(), publish: stmtCost(pickNotify, true)},
			costCase{name: "its statement, quiet", perTx: perTx, setup: outboxSetup(), publish: stmtCost(pickQuiet, false)},
			costCase{name: "its statement, LEFT JOIN lookup", perTx: perTx, setup: outboxSetup(), publish: leftJoinCost(one)},
			costCase{name: "  the groups as a parameter", perTx: perTx, setup: outboxSetup(), publish: groupsParamCost(one)},
			costCase{name: "outbox, no bindings lookup", perTx: perTx, setup: outboxSetup(), publish: unnestOrValues(one, "outbox")},
			costCase{name: "  keys in COLLATE \"C\"", perTx: perTx, setup: collateC(outboxSetup()), publish: unnestOrValues(one, "outbox")},
			costCase{name: "  without the partial indexes", perTx: perTx, setup: outboxSetup(partial...), publish: unnestOrValues(one, "outbox")},
			costCase{name: "  and without the ready index", perTx: perTx, setup: outboxSetup(append(partial, n.ReadyIdx)...), publish: unnestOrValues(one, "outbox")},
			costCase{name: "  ready index on an int4 hash key", perTx: perTx, setup: hashKeyed(outboxSetup(append(partial, n.ReadyIdx)...)), publish: unnestOrValues(one, "outbox")},
			costCase{name: "  one key, PK (topic,group,at,id)", perTx: perTx, setup: rekeyed(outboxSetup(append(partial, n.ReadyIdx)...)), publish: unnestOrValues(one, "outbox")},
			costCase{name: "arrivals table, PK (topic, id)", perTx: perTx, setup: sqlSetup(arrivalsTable), publish: unnestOrValues(one, "arrivals")},
			costCase{name: "bare table, same payload", perTx: perTx, setup: sqlSetup(bareTable), publish: unnestOrValues(one, "bare")},
			costCase{name: "watermill-sql queue table", perTx: perTx, setup: sqlSetup(watermillQueueTable), publish: valuesCost("queue", false, "json")},
		)
		if !one {
			// Fan-out: five groups bound. Today each gets a full row;
			// the alternative stores the payload once and gives each
			// group a narrow row that points at it.
			cases = append(cases,
				costCase{name: "Publisher, 1 group bound", perTx: perTx, setup: bound(outboxSetup(), 1), publish: publisherCost(0)},
				costCase{name: "Publisher, 5 groups bound", perTx: perTx, setup: bound(outboxSetup(), 5), publish: publisherCost(0)},
				costCase{name: "  with arrivals", perTx: perTx, setup: bound(arrivalsSetup, 5), publish: arrivalsPublisherCost},
				costCase{name: "payload once + 5 narrow rows", perTx: perTx, setup: sqlSetup(splitTables), publish: splitCost(5)},
			)
		}
	}
	return cases
}

// leftJoinCost is the publish statement with its groups found by one
// probe of the bindings' primary key, a left join that yields the default
// group when nothing is bound.
func leftJoinCost(one bool) func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
	return func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
		q := outboxQueries(s)
		groups := `(SELECT coalesce(b.consumer_group, '') FROM (SELECT) AS one LEFT JOIN ` + q.Names.QBindings + ` b ON b.topic = $1) AS g(consumer_group)`
		if one {
			_, err := t.Exec(ctx, `INSERT INTO `+q.Names.QTable+` (topic, consumer_group, uuid, payload, metadata)
SELECT $1, g.consumer_group, $2, $3, $4::jsonb FROM `+groups, topic, msgs[0].UUID, msgs[0].Payload, "{}")
			return err
		}
		uuids, payloads, metadata := columns(msgs)
		_, err := t.Exec(ctx, `INSERT INTO `+q.Names.QTable+` (topic, consumer_group, uuid, payload, metadata)
SELECT $1, g.consumer_group, m.uuid, m.payload, m.metadata::jsonb
  FROM unnest($2::text[], $3::bytea[], $4::text[]) AS m(uuid, payload, metadata) CROSS JOIN `+groups, topic, uuids, payloads, metadata)
		return err
	}
}

// rekeyed replaces the outbox's primary key on id and its ready index by
// one primary key that could serve the claim: (topic, consumer_group,
// available_at, id). A sketch for the comparison: the statements that find
// a row by its id alone would need the whole key.
func rekeyed(setup func(ctx context.Context, b *bench, s string) error) func(ctx context.Context, b *bench, s string) error {
	return func(ctx context.Context, b *bench, s string) error {
		if err := setup(ctx, b, s); err != nil {
			return err
		}
		t := pgx.Identifier{s, "outbox"}.Sanitize()
		_, err := b.pool.Exec(ctx, `ALTER TABLE `+t+` DROP CONSTRAINT outbox_pkey;
ALTER TABLE `+t+` ADD PRIMARY KEY (topic, consumer_group, available_at, id)`)
		return err
	}
}

// hashKeyed gives the outbox a ready index led by a 4-byte hash of its
// topic and group instead of the two text columns.
func hashKeyed(setup func(ctx context.Context, b *bench, s string) error) func(ctx context.Context, b *bench, s string) error {
	return func(ctx context.Context, b *bench, s string) error {
		if err := setup(ctx, b, s); err != nil {
			return err
		}
		t := pgx.Identifier{s, "outbox"}.Sanitize()
		_, err := b.pool.Exec(ctx, `ALTER TABLE `+t+` ADD COLUMN queue_key int4 GENERATED ALWAYS AS (hashtext(topic || chr(31) || consumer_group)) STORED;
CREATE INDEX ON `+t+` (queue_key, available_at, id) WHERE lease_token IS NULL`)
		return err
	}
}

// groupsParamCost is the publish statement with the groups given by the
// client instead of looked up: what the bindings lookup costs.
func groupsParamCost(one bool) func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
	return func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
		q := outboxQueries(s)
		groups := []string{""}
		if one {
			_, err := t.Exec(ctx, `INSERT INTO `+q.Names.QTable+` (topic, consumer_group, uuid, payload, metadata)
SELECT $1, g.consumer_group, $2, $3, $4::jsonb FROM unnest($5::text[]) AS g(consumer_group)`, topic, msgs[0].UUID, msgs[0].Payload, "{}", groups)
			return err
		}
		uuids, payloads, metadata := columns(msgs)
		_, err := t.Exec(ctx, `INSERT INTO `+q.Names.QTable+` (topic, consumer_group, uuid, payload, metadata)
SELECT $1, g.consumer_group, m.uuid, m.payload, m.metadata::jsonb
  FROM unnest($2::text[], $3::bytea[], $4::text[]) AS m(uuid, payload, metadata) CROSS JOIN unnest($5::text[]) AS g(consumer_group)`,
			topic, uuids, payloads, metadata, groups)
		return err
	}
}

// bound binds groups g0... to the bench topic.
func bound(setup func(ctx context.Context, b *bench, s string) error, groups int) func(ctx context.Context, b *bench, s string) error {
	return func(ctx context.Context, b *bench, s string) error {
		if err := setup(ctx, b, s); err != nil {
			return err
		}
		for g := range groups {
			if err := pgoutbox.Bind(ctx, tx.FromPgxPool(b.pool), schema.Config{Schema: s, Table: "outbox"}, topic, fmt.Sprintf("g%d", g)); err != nil {
				return err
			}
		}
		return nil
	}
}

// splitTables is a layout that stores a message once and gives each group
// a row of its own without the payload: what a fan-out would cost if a
// copy were only the delivery state (a sketch for the comparison, with the
// outbox's ready index on the narrow rows).
const splitTables = `CREATE TABLE %[1]s.messages (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic      text  NOT NULL,
    uuid       text  NOT NULL,
    payload    bytea NOT NULL,
    metadata   jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE %[1]s.deliveries (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic          text   NOT NULL,
    consumer_group text   NOT NULL,
    message_id     bigint NOT NULL,
    available_at   timestamptz NOT NULL DEFAULT now(),
    deliveries     integer NOT NULL DEFAULT 0,
    lease_token    uuid,
    leased_until   timestamptz);
CREATE INDEX ON %[1]s.deliveries (topic, consumer_group, available_at, id) WHERE lease_token IS NULL;
CREATE TABLE %[1]s.groups (topic text, consumer_group text, PRIMARY KEY (topic, consumer_group));
INSERT INTO %[1]s.groups SELECT 'bench', 'g' || g FROM generate_series(0, 4) g`

func splitCost(groups int) func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
	return func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
		q := pgx.Identifier{s}.Sanitize()
		uuids, payloads, metadata := columns(msgs)
		_, err := t.Exec(ctx, `WITH m AS (
    INSERT INTO `+q+`.messages (topic, uuid, payload, metadata)
    SELECT $1, m.uuid, m.payload, m.metadata::jsonb FROM unnest($2::text[], $3::bytea[], $4::text[]) AS m(uuid, payload, metadata)
    RETURNING id)
INSERT INTO `+q+`.deliveries (topic, consumer_group, message_id)
SELECT $1, g.consumer_group, m.id FROM m CROSS JOIN `+q+`.groups g WHERE g.topic = $1`, topic, uuids, payloads, metadata)
		return err
	}
}

// unnestOrValues is the cheapest statement shape for the batch: VALUES for
// one message, arrays for many (as the Publisher chooses).
func unnestOrValues(one bool, table string) func(ctx context.Context, t pgx.Tx, s string, msgs []*message.Message) error {
	if one {
		return valuesCost(table, true, "jsonb")
	}
	return unnestCost(table)
}

// costFigures are one case's measurements, per transaction.
type costFigures struct {
	wallUs, serverUs, clientUs, walBytes float64
}

// runPublishCost measures every case rounds times, interleaved, and prints
// the medians.
func runPublishCost(ctx context.Context, b *bench, w io.Writer, txs, rounds int) error {
	var cases []costCase
	for _, c := range costCases() {
		if b.opts.publishCostSize == 0 || c.perTx == b.opts.publishCostSize {
			cases = append(cases, c)
		}
	}
	results := make([][]costFigures, len(cases))
	for r := 0; r < rounds; r++ {
		// Each round starts one case later: no case always follows the
		// same neighbour (a checkpoint, a dropped schema's cleanup).
		for k := range cases {
			i := (k + r) % len(cases)
			c := cases[i]
			f, err := b.measureCost(ctx, c, i, txs)
			if err != nil {
				return fmt.Errorf("%s (%d per tx): %w", c.name, c.perTx, err)
			}
			results[i] = append(results[i], f)
			fmt.Fprintf(b.progress, "[%d/%d] %-32s %3d/tx  wall %7.1f µs  server %6.1f µs  client %6.1f µs  WAL %6.0f B\n",
				r+1, rounds, c.name, c.perTx, f.wallUs, f.serverUs, f.clientUs, f.walBytes)
		}
	}
	fmt.Fprintf(w, "\nPublish cost per transaction (medians of %d rounds of %d transactions; server and client are CPU time):\n", rounds, txs)
	fmt.Fprintf(w, "%-34s %6s %10s %10s %10s %10s %12s\n", "case", "msgs", "wall µs", "server µs", "client µs", "WAL bytes", "msgs/s wall")
	for i, c := range cases {
		med := func(f func(costFigures) float64) float64 {
			xs := make([]float64, len(results[i]))
			for k, r := range results[i] {
				xs[k] = f(r)
			}
			sort.Float64s(xs)
			return median(xs)
		}
		wall := med(func(f costFigures) float64 { return f.wallUs })
		server := med(func(f costFigures) float64 { return f.serverUs })
		fmt.Fprintf(w, "%-34s %6d %10.1f %10s %10.1f %10.0f %12.0f\n", c.name, c.perTx, wall,
			serverFigure(server), med(func(f costFigures) float64 { return f.clientUs }),
			med(func(f costFigures) float64 { return f.walBytes }), float64(c.perTx)*1e6/wall)
	}
	return nil
}

func serverFigure(us float64) string {
	if us < 0 {
		return "-"
	}
	return strconv.FormatFloat(us, 'f', 1, 64)
}

func (b *bench) measureCost(ctx context.Context, c costCase, i, txs int) (costFigures, error) {
	s := fmt.Sprintf("bench_cost_%d", i)
	if _, err := b.pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{s}.Sanitize()+` CASCADE`); err != nil {
		return costFigures{}, err
	}
	if _, err := b.pool.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{s}.Sanitize()); err != nil {
		return costFigures{}, err
	}
	defer b.pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{s}.Sanitize()+` CASCADE`)
	if err := c.setup(ctx, b, s); err != nil {
		return costFigures{}, err
	}
	conn, err := b.conn(ctx)
	if err != nil {
		return costFigures{}, err
	}
	defer conn.Close(context.Background())
	var pid int
	if err := conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		return costFigures{}, err
	}
	payload := newPayload()
	oneTx := func() error {
		t, err := conn.Begin(ctx)
		if err != nil {
			return err
		}
		if err := c.publish(ctx, t, s, newMessages(c.perTx, payload)); err != nil {
			_ = t.Rollback(context.Background())
			return err
		}
		return t.Commit(ctx)
	}
	// Warm up: statement cache, generic plans, the table's first pages.
	for range 50 {
		if err := oneTx(); err != nil {
			return costFigures{}, err
		}
	}
	lsn := func() (int64, error) {
		var v int64
		err := conn.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn`).Scan(&v)
		return v, err
	}
	wal0, err := lsn()
	if err != nil {
		return costFigures{}, err
	}
	srv0 := backendCPU(pid)
	cli0 := processCPU()
	start := time.Now()
	for range txs {
		if err := oneTx(); err != nil {
			return costFigures{}, err
		}
	}
	wall := time.Since(start)
	cli1 := processCPU()
	srv1 := backendCPU(pid)
	wal1, err := lsn()
	if err != nil {
		return costFigures{}, err
	}
	n := float64(txs)
	f := costFigures{
		wallUs:   float64(wall.Microseconds()) / n,
		clientUs: float64((cli1 - cli0).Microseconds()) / n,
		walBytes: float64(wal1-wal0) / n,
		serverUs: -1,
	}
	if srv0 >= 0 && srv1 >= 0 {
		f.serverUs = float64((srv1 - srv0).Microseconds()) / n
	}
	return f, nil
}
