package drivers_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/lib/pq" // the "postgres" driver, v1.10.9: no slices
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// libpq opens a database/sql pool with lib/pq on env's database, closed
// when the test ends.
func libpq(t *testing.T, env *pgoutboxtest.Env) *sql.DB {
	t.Helper()
	dsn := env.DSN
	if !strings.Contains(dsn, "sslmode=") {
		sep := "?"
		if strings.Contains(dsn, "?") {
			sep = "&"
		}
		dsn += sep + "sslmode=disable"
	}
	db, err := sql.Open("postgres", dsn)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	require.NoError(t, db.PingContext(context.Background()))
	return db
}

// Every shape of Publish in a lib/pq transaction, each with its domain
// row: one plain message, a batch, a dedup key, an ordering key (given
// and generated), a time to deliver at; the subscriber receives each
// message as it was published, and a rolled-back transaction publishes
// nothing.
func TestLibPQPublishesEveryShape(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	db := libpq(t, env)
	ctx := context.Background()
	_, err := db.ExecContext(ctx, `CREATE TABLE `+env.Schema+`.orders (id text PRIMARY KEY)`)
	require.NoError(t, err)

	msg := func(payload string) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte(payload))
		m.Metadata.Set("kind", "née \"quoted\" \\ back")
		return m
	}
	keyed, deduped, at := msg("keyed"), msg("deduped"), msg("at")
	pgoutbox.WithOrderingKey(keyed, "customer-1")
	pgoutbox.WithDedupKey(deduped, "order-7")
	pgoutbox.DeliverAt(at, time.Now().Add(-time.Second))
	calls := map[string][]*message.Message{
		"one":     {msg("one")},
		"batch":   {msg("b1"), msg("b2"), msg("b3")},
		"keyed":   {keyed},
		"deduped": {deduped},
		"at":      {at},
		"binary":  {message.NewMessage(watermill.NewUUID(), []byte{0, 1, 0xfe, '"', '\\', 0xff})},
	}
	var sent []*message.Message
	for name, msgs := range calls {
		st, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		t.Cleanup(func() { _ = st.Rollback() }) // a failed step must not keep its locks
		_, err = st.ExecContext(ctx, `INSERT INTO `+env.Schema+`.orders VALUES ($1)`, name)
		require.NoError(t, err)
		pub, err := pgoutbox.NewTxPublisher(st, pgoutbox.PublisherConfig{Tables: env.Tables}, nil)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("orders", msgs...), "publish %s", name)
		require.NoError(t, st.Commit())
		sent = append(sent, msgs...)
	}
	generated, err := pgoutbox.NewPublisher(tx.FromSQLDB(db), pgoutbox.PublisherConfig{
		Tables: env.Tables, GenerateOrderingKey: func(string, *message.Message) (string, error) { return "gen", nil },
	}, nil)
	require.NoError(t, err)
	gen := []*message.Message{msg("g1"), msg("g2")}
	require.NoError(t, generated.Publish("orders", gen...))
	sent = append(sent, gen...)

	st, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	pub, err := pgoutbox.NewTxPublisher(st, pgoutbox.PublisherConfig{Tables: env.Tables}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders", msg("r1"), msg("r2")))
	require.NoError(t, st.Rollback())

	got := env.Drain(t, "orders", len(sent), 20*time.Second)
	byUUID := map[string]*message.Message{}
	for _, m := range got {
		byUUID[m.UUID] = m
	}
	for _, m := range sent {
		g, ok := byUUID[m.UUID]
		require.True(t, ok, "message %s (%q) not received", m.UUID, m.Payload)
		require.Equal(t, []byte(m.Payload), []byte(g.Payload))
		require.Equal(t, m.Metadata.Get("kind"), g.Metadata.Get("kind"))
	}
	require.Len(t, got, len(sent), "the rolled-back messages are not published")
}

// The operator's calls that take lists, and Peek of a parked row, through
// lib/pq: binding groups, requeueing and deleting dead letters by id,
// requeueing parked rows.
func TestLibPQOperatorCalls(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	t.Run("groups and dead letters", func(t *testing.T) {
		t.Parallel()
		env := pgoutboxtest.PubSub(t)
		exec := tx.FromSQLDB(libpq(t, env))
		res, err := pgoutbox.BindGroups(ctx, exec, env.Tables, "orders", []string{"billing", "shipping"})
		require.NoError(t, err)
		require.ElementsMatch(t, []string{"billing", "shipping"}, res.New)
		for _, uuid := range []string{watermill.NewUUID(), watermill.NewUUID()} {
			_, err := env.Pool.Exec(ctx, `INSERT INTO `+env.Schema+`.outbox_dlq (id, topic, consumer_group, uuid, payload, metadata, created_at, deliveries, failure_reason, failed_at)
				VALUES (nextval(pg_get_serial_sequence('`+env.Schema+`.outbox', 'id')), 'orders', 'billing', $1, 'x', '{}', now(), 1, 'rejected', now())`, uuid)
			require.NoError(t, err)
		}
		page, err := pgoutbox.DeadLetters(ctx, exec, env.Tables, pgoutbox.DeadLetterFilter{})
		require.NoError(t, err)
		require.Len(t, page.Letters, 2)
		n, err := pgoutbox.RequeueDeadLetters(ctx, exec, env.Tables, []int64{page.Letters[0].ID})
		require.NoError(t, err)
		require.EqualValues(t, 1, n)
		n, err = pgoutbox.DeleteDeadLetters(ctx, exec, env.Tables, []int64{page.Letters[1].ID})
		require.NoError(t, err)
		require.EqualValues(t, 1, n)
	})
	t.Run("parked rows", func(t *testing.T) {
		t.Parallel()
		env := pgoutboxtest.PubSubWithOptions(t, pgoutboxtest.Options{NoDeadLetterTable: true})
		exec := tx.FromSQLDB(libpq(t, env))
		require.NoError(t, env.Publisher.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte("a")), message.NewMessage(watermill.NewUUID(), []byte("b"))))
		var parked int64
		require.NoError(t, env.Pool.QueryRow(ctx, `UPDATE `+env.Schema+`.outbox SET available_at = 'infinity', failure_reason = 'rejected'
			WHERE id = (SELECT min(id) FROM `+env.Schema+`.outbox) RETURNING id`).Scan(&parked))
		pending, err := pgoutbox.Peek(ctx, exec, env.Tables, "orders", "", 0)
		require.NoError(t, err)
		require.Len(t, pending, 2)
		require.False(t, pending[0].Parked)
		require.True(t, pending[1].Parked, "the parked row comes last, marked parked")
		require.Equal(t, parked, pending[1].ID)
		n, err := pgoutbox.RequeueParked(ctx, exec, env.Tables, pgoutbox.ParkedFilter{IDs: []int64{parked}})
		require.NoError(t, err)
		require.EqualValues(t, 1, n)
		// Without IDs (nil: any row): NULL, not an empty array that
		// matches nothing.
		_, err = env.Pool.Exec(ctx, `UPDATE `+env.Schema+`.outbox SET available_at = 'infinity', failure_reason = 'rejected'`)
		require.NoError(t, err)
		n, err = pgoutbox.RequeueParked(ctx, exec, env.Tables, pgoutbox.ParkedFilter{})
		require.NoError(t, err)
		require.EqualValues(t, 2, n, "every parked row")
	})
}

// A server error through lib/pq gets the same advice as through pgx: a
// publish into a missing outbox says to create it, one in a failed
// transaction says to roll back.
func TestLibPQErrorsSayWhatToDo(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	db := libpq(t, env)
	ctx := context.Background()

	missing := env.Tables
	missing.Table = "no_such_outbox"
	pub, err := pgoutbox.NewPublisher(tx.FromSQLDB(db), pgoutbox.PublisherConfig{Tables: missing}, nil)
	require.NoError(t, err)
	err = pub.Publish("orders", message.NewMessage(watermill.NewUUID(), nil))
	require.ErrorContains(t, err, "run schema.Create")

	st, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = st.Rollback() }()
	_, err = st.ExecContext(ctx, `SELECT 1/0`)
	require.Error(t, err)
	pub, err = pgoutbox.NewTxPublisher(st, pgoutbox.PublisherConfig{Tables: env.Tables}, nil)
	require.NoError(t, err)
	err = pub.Publish("orders", message.NewMessage(watermill.NewUUID(), nil))
	require.ErrorContains(t, err, "roll it back")
}
