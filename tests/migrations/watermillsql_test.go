package migrations_test

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// docSQL returns the ```sql block of docs/from-watermill-sql.md marked
// <!-- sql: name -->: the test runs what the guide says to run.
func docSQL(t *testing.T, name string) string {
	t.Helper()
	doc, err := os.ReadFile("../../docs/from-watermill-sql.md")
	require.NoError(t, err)
	m := regexp.MustCompile("(?s)<!-- sql: " + name + " -->\n```sql\n(.*?)```").FindSubmatch(doc)
	require.NotNil(t, m, "docs/from-watermill-sql.md has a block marked sql: %s", name)
	return string(m[1])
}

// moveBundle is a schema where watermill-sql's tables and a pgoutbox
// outbox live side by side, as the guide's statements name them
// (unqualified, through the search_path).
type moveBundle struct {
	ctx    context.Context
	pool   *pgxpool.Pool
	tables schema.Config
	logger watermill.LoggerAdapter
}

func newMoveBundle(t *testing.T) *moveBundle {
	t.Helper()
	s := pgoutboxtest.NewSchema(t, pgoutboxtest.Options{})
	cfg, err := pgxpool.ParseConfig(s.DSN)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["search_path"] = s.Name
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	b := &moveBundle{ctx: context.Background(), pool: pool, tables: schema.Config{Schema: s.Name}, logger: watermill.NopLogger{}}
	require.NoError(t, schema.Create(b.ctx, tx.FromPgxPool(pool), b.tables))
	return b
}

// publishOld publishes n messages to topic with watermill-sql, each with
// a metadata key, and returns their UUIDs in publish order. The last also
// carries Watermill's delay metadata, an hour ahead, as delay.NewPublisher
// writes it.
func (b *moveBundle) publishOld(t *testing.T, schemaAdapter wsql.SchemaAdapter, topic string, n int) []string {
	t.Helper()
	pub, err := wsql.NewPublisher(wsql.BeginnerFromPgx(b.pool), wsql.PublisherConfig{SchemaAdapter: schemaAdapter, AutoInitializeSchema: true}, b.logger)
	require.NoError(t, err)
	var uuids []string
	for i := range n {
		m := message.NewMessage(watermill.NewUUID(), fmt.Appendf(nil, `{"n":%d}`, i))
		m.Metadata.Set("seq", fmt.Sprint(i))
		if i == n-1 {
			delay.Message(m, delay.For(time.Hour))
		}
		require.NoError(t, pub.Publish(topic, m))
		uuids = append(uuids, m.UUID)
	}
	return uuids
}

// requireDelayKept checks that the delayed message (publishOld's last)
// moved with its time, about an hour ahead, in every group.
func (b *moveBundle) requireDelayKept(t *testing.T, uuid string, copies int) {
	t.Helper()
	var later int
	require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT count(*) FROM outbox WHERE uuid = $1 AND available_at > now() + interval '50 minutes'`, uuid).Scan(&later))
	require.Equal(t, copies, later, "the delayed message keeps its delivery time")
}

// consumeOld handles and acks the first n messages of topic with a
// watermill-sql subscriber, then stops it, as step 3 of the guide does.
//
// committed reports whether watermill-sql has written the acks down (its
// offset, or its acked column); it is awaited before the subscriber
// closes: watermill-sql commits after the Ack, and a Close in between
// rolled the last one back (a loaded CI run saw three of four).
func (b *moveBundle) consumeOld(t *testing.T, cfg wsql.SubscriberConfig, topic string, n int, committed func() bool) {
	t.Helper()
	cfg.InitializeSchema = true
	cfg.PollInterval = 20 * time.Millisecond
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromPgx(b.pool), cfg, b.logger)
	require.NoError(t, err)
	msgs, err := sub.Subscribe(b.ctx, topic)
	require.NoError(t, err)
	for range n {
		select {
		case m := <-msgs:
			m.Ack()
		case <-time.After(30 * time.Second):
			t.Fatal("watermill-sql delivered nothing within 30s")
		}
	}
	require.Eventually(t, committed, 10*time.Second, 10*time.Millisecond, "watermill-sql wrote down the %d acks", n)
	require.NoError(t, sub.Close())
}

// drainNew receives want messages of topic with a pgoutbox subscriber
// of group and checks their UUIDs, order, payloads and metadata.
func (b *moveBundle) drainNew(t *testing.T, topic, group string, want []string) {
	t.Helper()
	sub, err := pgoutbox.NewSubscriber(b.pool, pgoutbox.SubscriberConfig{Tables: b.tables, ConsumerGroup: group, MaxInFlight: 1}, b.logger)
	require.NoError(t, err)
	defer sub.Close()
	got := pgoutboxtest.Drain(t, sub, topic, len(want), 30*time.Second)
	var uuids []string
	for _, m := range got {
		uuids = append(uuids, m.UUID)
		require.Regexp(t, `^\{"n":\d+\}$`, string(m.Payload), "the payload's bytes kept")
		require.Equal(t, strings.TrimSuffix(strings.TrimPrefix(string(m.Payload), `{"n":`), "}"), m.Metadata.Get("seq"), "the metadata kept")
	}
	require.Equal(t, want, uuids, "every message not handled before, once, in publish order")
}

func (b *moveBundle) exec(t *testing.T, sql string) int64 {
	t.Helper()
	tag, err := b.pool.Exec(b.ctx, sql)
	require.NoError(t, err)
	return tag.RowsAffected()
}

// The guide's moves (docs/from-watermill-sql.md), on tables watermill-sql
// made and filled: what its subscribers had not handled reaches pgoutbox's
// subscribers once, in order, with its payload and metadata; a second run
// moves nothing.
func TestMoveFromWatermillSQL(t *testing.T) {
	t.Parallel()

	t.Run("QueueSchema", func(t *testing.T) {
		t.Parallel()
		b := newMoveBundle(t)
		// Step 1: the default group is bound before the move, so a
		// running subscriber claims the moved rows.
		require.NoError(t, pgoutbox.Bind(b.ctx, tx.FromPgxPool(b.pool), b.tables, "orders", ""))
		queue := wsql.PostgreSQLQueueSchema{}
		uuids := b.publishOld(t, queue, "orders", 10)
		// One message a transaction, so that what it acks is what was
		// handled: closed in the middle of a batch of ten, it had marked all
		// ten acked.
		oneByOne := wsql.PostgreSQLQueueSchema{SubscribeBatchSize: 1}
		var left int
		b.consumeOld(t, wsql.SubscriberConfig{SchemaAdapter: oneByOne, OffsetsAdapter: wsql.PostgreSQLQueueOffsetsAdapter{}}, "orders", 3, func() bool {
			return b.pool.QueryRow(b.ctx, `SELECT count(*) FROM watermill_orders WHERE NOT acked`).Scan(&left) == nil && left == 7
		})
		require.Equal(t, 7, left, "watermill-sql handled three")

		move := docSQL(t, "queue")
		require.Equal(t, int64(7), b.exec(t, move))
		require.Equal(t, int64(0), b.exec(t, move), "run again, it moves nothing")
		b.requireDelayKept(t, uuids[9], 1)
		b.drainNew(t, "orders", "", uuids[3:9])
	})

	// Subscribers with a group of their own (a CQRS handler's name): step 1
	// binds it and the move writes it, as the guide says.
	t.Run("QueueSchemaIntoANamedGroup", func(t *testing.T) {
		t.Parallel()
		b := newMoveBundle(t)
		require.NoError(t, pgoutbox.Bind(b.ctx, tx.FromPgxPool(b.pool), b.tables, "orders", "book_room"))
		uuids := b.publishOld(t, wsql.PostgreSQLQueueSchema{}, "orders", 10)
		move := docSQL(t, "queue")
		named := strings.Replace(move, "SELECT 'orders', '', uuid", "SELECT 'orders', 'book_room', uuid", 1)
		require.NotEqual(t, move, named, "the guide's statement names the group where the test writes it")
		require.Equal(t, int64(10), b.exec(t, named))
		b.drainNew(t, "orders", "book_room", uuids[:9])
	})

	t.Run("LogSchemaWithGroups", func(t *testing.T) {
		t.Parallel()
		b := newMoveBundle(t)
		// Step 1: the groups are bound in pgoutbox before the move.
		for _, g := range []string{"", "billing"} {
			require.NoError(t, pgoutbox.Bind(b.ctx, tx.FromPgxPool(b.pool), b.tables, "orders", g))
		}
		log := wsql.DefaultPostgreSQLSchema{}
		offsets := wsql.DefaultPostgreSQLOffsetsAdapter{}
		uuids := b.publishOld(t, log, "orders", 10)
		// One message a transaction, so that the offset committed when it
		// closes is that of the last message handled (with batches of 100
		// it was not always, on a loaded machine).
		oneByOne := wsql.DefaultPostgreSQLSchema{SubscribeBatchSize: 1}
		var acked int
		b.consumeOld(t, wsql.SubscriberConfig{SchemaAdapter: oneByOne, OffsetsAdapter: offsets, ConsumerGroup: "billing"}, "orders", 4, func() bool {
			return b.pool.QueryRow(b.ctx, `SELECT count(*) FROM watermill_orders m JOIN watermill_offsets_orders o
  ON o.consumer_group = 'billing' AND (m.transaction_id, m."offset") <= (o.last_processed_transaction_id, o.offset_acked)`).Scan(&acked) == nil && acked == 4
		})
		require.Equal(t, 4, acked, "watermill-sql's billing group handled four")

		move := docSQL(t, "log")
		require.Contains(t, move, "'billing'")
		require.Equal(t, int64(1), b.exec(t, move), "the offset row written")
		require.Equal(t, int64(0), b.exec(t, move), "run again, it moves nothing")
		def := strings.ReplaceAll(move, "'billing'", "''")
		require.Equal(t, int64(1), b.exec(t, def))
		require.Equal(t, int64(0), b.exec(t, def))

		var perGroup string
		require.NoError(t, b.pool.QueryRow(b.ctx, `SELECT string_agg(g || '=' || n, ',' ORDER BY g)
  FROM (SELECT consumer_group AS g, count(*) AS n FROM outbox GROUP BY 1) c`).Scan(&perGroup))
		require.Equal(t, "=10,billing=6", perGroup)
		b.requireDelayKept(t, uuids[9], 2)
		b.drainNew(t, "orders", "billing", uuids[4:9])
		b.drainNew(t, "orders", "", uuids[:9])
	})
}
