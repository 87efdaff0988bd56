package tests

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// TestPublishBadInput sends each bad input after two good messages through a
// pool publisher, which commits on its own: if anything of the call were
// written, it would stay.
func TestPublishBadInput(t *testing.T) {
	t.Parallel()
	b := setup(t)

	const topic = "bad_input"
	withMeta := func(k, v string) *message.Message {
		m := newMsg("bad")
		m.Metadata.Set(k, v)
		return m
	}
	for name, tc := range map[string]struct {
		topic string
		bad   func() []*message.Message // appended after two good messages
		is    error
		want  []string // what is wrong, where, and what to do
	}{
		"EmptyTopic": {
			topic: "",
			bad:   func() []*message.Message { return nil },
			is:    pgoutbox.ErrInvalidTopic,
			want:  []string{"topic is empty", "pass the topic name"},
		},
		"TopicInvalidUTF8": {
			topic: "orders\xff",
			bad:   func() []*message.Message { return nil },
			is:    pgoutbox.ErrInvalidTopic,
			want:  []string{`"orders\xff"`, "not valid UTF-8", "stored as text"},
		},
		"TopicWithNUL": {
			topic: "orders\x00",
			bad:   func() []*message.Message { return nil },
			is:    pgoutbox.ErrInvalidTopic,
			want:  []string{`"orders\x00"`, "control character", "printable"},
		},
		"TopicWithScheduleMark": {
			// chr(31) marks scheduled-only wake-ups on the NOTIFY channel.
			topic: "\x1forders",
			bad:   func() []*message.Message { return nil },
			is:    pgoutbox.ErrInvalidTopic,
			want:  []string{"control character"},
		},
		"TopicTooLong": {
			topic: strings.Repeat("t", 1025),
			bad:   func() []*message.Message { return nil },
			is:    pgoutbox.ErrInvalidTopic,
			want:  []string{"1025 bytes", "at most 1024"},
		},
		"NilMessageInTheMiddle": {
			bad: func() []*message.Message { return []*message.Message{nil, newMsg("after")} },
			is:  pgoutbox.ErrInvalidMessage,
			// The nil one is the third of the call.
			want: []string{"message 2 is nil"},
		},
		"DuplicateUUIDs": {
			bad: func() []*message.Message {
				m := newMsg("bad")
				return []*message.Message{m, message.NewMessage(m.UUID, []byte("twin"))}
			},
			is:   pgoutbox.ErrInvalidMessage,
			want: []string{"messages 2 and 3 have the same UUID", "watermill.NewUUID()"},
		},
		"NoUUID": {
			bad:  func() []*message.Message { return []*message.Message{message.NewMessage("", []byte("anonymous"))} },
			is:   pgoutbox.ErrInvalidMessage,
			want: []string{"message 2 has no UUID", "watermill.NewUUID()"},
		},
		"UUIDInvalidUTF8": {
			bad:  func() []*message.Message { return []*message.Message{message.NewMessage("id\xff", nil)} },
			is:   pgoutbox.ErrInvalidMessage,
			want: []string{"message 2", "UUID is not valid UTF-8"},
		},
		"MetadataValueInvalidUTF8": {
			bad:  func() []*message.Message { return []*message.Message{withMeta("k", "\xff")} },
			is:   pgoutbox.ErrInvalidMessage,
			want: []string{"message 2", `metadata value of "k" is not valid UTF-8`, "base64", "payload"},
		},
		"MetadataKeyInvalidUTF8": {
			bad:  func() []*message.Message { return []*message.Message{withMeta("k\xff", "v")} },
			is:   pgoutbox.ErrInvalidMessage,
			want: []string{"message 2", `metadata key "k\xff" is not valid UTF-8`, "base64"},
		},
		"MetadataValueWithNUL": {
			bad:  func() []*message.Message { return []*message.Message{withMeta("k", "a\x00b")} },
			is:   pgoutbox.ErrInvalidMessage,
			want: []string{"message 2", `metadata value of "k" contains a NUL byte`, "remove it or encode the value"},
		},
		"MetadataKeyWithNUL": {
			bad:  func() []*message.Message { return []*message.Message{withMeta("k\x00", "v")} },
			is:   pgoutbox.ErrInvalidMessage,
			want: []string{"message 2", "contains a NUL byte"},
		},
		"UnparsableDelayedFor": {
			bad: func() []*message.Message {
				m := withMeta(delay.DelayedForKey, "soon") // "delayed for" counts with "delayed until" only
				m.Metadata.Set(delay.DelayedUntilKey, time.Now().UTC().Format(time.RFC3339))
				return []*message.Message{m}
			},
			is:   pgoutbox.ErrInvalidMessage,
			want: []string{"message 2", `_watermill_delayed_for="soon" is not a duration`},
		},
		"UnparsableDelayedUntil": {
			bad:  func() []*message.Message { return []*message.Message{withMeta(delay.DelayedUntilKey, "tomorrow")} },
			is:   pgoutbox.ErrInvalidMessage,
			want: []string{"message 2", `_watermill_delayed_until="tomorrow"`},
		},
		"EmptyDedupKey": {
			bad: func() []*message.Message {
				m := newMsg("bad")
				pgoutbox.WithDedupKey(m, "")
				return []*message.Message{m}
			},
			is:   pgoutbox.ErrInvalidMessage,
			want: []string{"message 2", "dedup key is empty", "non-empty key to WithDedupKey"},
		},
		// A key is an index entry: the server refuses one over 2,704 bytes
		// (incompressible), aborting the transaction.
		"LongDedupKey": {
			bad: func() []*message.Message {
				m := newMsg("bad")
				pgoutbox.WithDedupKey(m, randomKey(3000))
				return []*message.Message{m}
			},
			is:   pgoutbox.ErrInvalidMessage,
			want: []string{"message 2", "dedup key is 3000 bytes long", "at most 512", "hash"},
		},
		"LongOrderingKey": {
			bad: func() []*message.Message {
				m := newMsg("bad")
				pgoutbox.WithOrderingKey(m, randomKey(513))
				return []*message.Message{m}
			},
			is:   pgoutbox.ErrInvalidMessage,
			want: []string{"message 2", "ordering key is 513 bytes long", "at most 512"},
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			top := topic + "_" + name
			if tc.topic != "" || name == "EmptyTopic" {
				top = tc.topic
			}
			msgs := append([]*message.Message{newMsg("good 0"), newMsg("good 1")}, tc.bad()...)

			res, err := b.poolPublisher(t).PublishWithResult(top, msgs...)
			require.ErrorIs(t, err, tc.is)
			require.Empty(t, res.IDs)
			for _, w := range tc.want {
				require.Contains(t, err.Error(), w)
			}
			require.Equal(t, 0, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE uuid = ANY($1)`,
				[]string{msgs[0].UUID, msgs[1].UUID}), "nothing of the call is written")

			// The same through a transaction: the error leaves it usable.
			ctx := context.Background()
			pt, err := b.Pool.Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = pt.Rollback(ctx) }()
			pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pt), pgoutbox.PublisherConfig{Tables: b.tables}, b.logger)
			require.NoError(t, err)
			require.ErrorIs(t, pub.Publish(top, msgs...), tc.is)
			require.NoError(t, pub.Publish("after_"+name, newMsg("fine")))
			require.NoError(t, pt.Commit(ctx))
			require.Equal(t, 1, b.outboxRows(t, "after_"+name))
		})
	}
}

// randomKey returns n random letters: a key PostgreSQL cannot compress.
func randomKey(n int) string {
	const letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
	k := make([]byte, n)
	for i := range k {
		k[i] = letters[rand.IntN(len(letters))]
	}
	return string(k)
}

// Each bad input's error should say what to do, so a caller can fix the
// call from the message alone.
func TestPublishBadInputSaysWhatToDo(t *testing.T) {
	t.Parallel()
	b := setup(t)
	pub := b.poolPublisher(t)

	err := pub.Publish("hint", newMsg("a"), nil)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidMessage)
	require.Regexp(t, `(?i)remove|non-nil|pass`, err.Error())

	m := newMsg("a")
	delay.Message(m, delay.For(time.Second))
	m.Metadata.Set(delay.DelayedForKey, "soon")
	err = pub.Publish("hint", m)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidMessage)
	require.Regexp(t, `(?i)use|such as|for example|delay\.`, err.Error())
}

// notCreated is b's tables with an outbox table (and no dead-letter
// table) that was never created.
func notCreated(b *bundle) schema.Config {
	missing := b.tables
	missing.Table = "not_created"
	missing.DeadLetterTable = ""
	return missing
}

func TestPublishToMissingTable(t *testing.T) {
	t.Parallel()
	b := setup(t)
	missing := notCreated(b)

	for name, exec := range map[string]tx.Executor{
		"FromPgxPool": tx.FromPgxPool(b.Pool),
		"FromSQLDB":   tx.FromSQLDB(b.sqlDB(t)),
	} {
		pub, err := pgoutbox.NewPublisher(exec, pgoutbox.PublisherConfig{Tables: missing}, b.logger)
		require.NoError(t, err, "the constructor does not touch the database")
		err = pub.Publish("orders", newMsg("lost?"))
		require.Error(t, err, name)
		require.Contains(t, err.Error(), `table "`+b.Schema+`"."not_created" does not exist`, name)
		require.Contains(t, err.Error(), "schema.Create", name)
		require.Contains(t, err.Error(), "schema.SQL", name)
	}
	require.Equal(t, 0, b.outboxRows(t, "orders"))
}

// The operator's functions on an outbox whose tables were never created
// say how to create them, as Publish does.
func TestOperatorFunctionsOnMissingTablesSayHowToCreateThem(t *testing.T) {
	t.Parallel()
	b := setup(t)
	missing := notCreated(b)
	missing.NoDeadLetterTable = true
	exec := tx.FromPgxPool(b.Pool)

	_, err := pgoutbox.Stats(t.Context(), exec, missing)
	require.Error(t, err)
	require.Contains(t, err.Error(), "pgoutbox schema apply", "Stats")
	_, err = pgoutbox.BindGroups(t.Context(), exec, missing, "orders", []string{"billing"})
	require.Error(t, err)
	require.Contains(t, err.Error(), "pgoutbox schema apply", "BindGroups")

	// A schema that was never made: whichever of its tables the statement
	// names first.
	nowhere := schema.Config{Schema: "never_applied_" + strings.ReplaceAll(b.Schema, "-", "_"), NoDeadLetterTable: true}
	_, err = pgoutbox.Stats(t.Context(), exec, nowhere)
	require.Error(t, err)
	require.Contains(t, err.Error(), "pgoutbox schema apply", "Stats")
	err = pgoutbox.Bind(t.Context(), exec, nowhere, "orders", "billing")
	require.Error(t, err)
	require.Contains(t, err.Error(), "pgoutbox schema apply", "Bind")
}

func TestConstructorsRefuseBadConfig(t *testing.T) {
	t.Parallel()
	b := setup(t)

	for _, table := range []string{"bad name", "1abc", `x";drop`, strings.Repeat("a", 64)} {
		cfg := b.tables
		cfg.Table = table

		pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: cfg}, b.logger)
		require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig, table)
		require.Nil(t, pub)
		require.Contains(t, err.Error(), fmt.Sprintf("%q", table))

		sub, err := pgoutbox.NewSubscriber(b.Pool, pgoutbox.SubscriberConfig{Tables: cfg}, b.logger)
		require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig, table)
		require.Nil(t, sub)
		require.Contains(t, err.Error(), "table name")
	}

	sub, err := pgoutbox.NewSubscriber(nil, pgoutbox.SubscriberConfig{}, b.logger)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.Contains(t, err.Error(), "pool is nil")
	require.Nil(t, sub)

	pub, err := pgoutbox.NewPublisher(nil, pgoutbox.PublisherConfig{}, b.logger)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.Contains(t, err.Error(), "executor is nil")
	require.Nil(t, pub)

	pub, err = pgoutbox.NewTxPublisher(nil, pgoutbox.PublisherConfig{}, b.logger)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.Nil(t, pub)
}

func TestSubscribeBadInput(t *testing.T) {
	t.Parallel()
	b := setup(t)

	t.Run("EmptyTopic", func(t *testing.T) {
		t.Parallel()
		ch, err := b.subscriber(t, nil).Subscribe(t.Context(), "")
		require.ErrorIs(t, err, pgoutbox.ErrInvalidTopic)
		require.Nil(t, ch)
	})

	t.Run("InvalidTopic", func(t *testing.T) {
		t.Parallel()
		sub := b.subscriber(t, nil)
		_, err := sub.Subscribe(t.Context(), "bad\xff")
		require.ErrorIs(t, err, pgoutbox.ErrInvalidTopic)
		require.ErrorIs(t, sub.SubscribeInitialize(""), pgoutbox.ErrInvalidTopic)
	})

	t.Run("AfterClose", func(t *testing.T) {
		t.Parallel()
		sub := b.subscriber(t, nil)
		require.NoError(t, sub.Close())
		ch, err := sub.Subscribe(t.Context(), "closed")
		require.ErrorIs(t, err, pgoutbox.ErrSubscriberClosed)
		require.Contains(t, err.Error(), "create a new subscriber")
		require.Nil(t, ch)
		require.NoError(t, sub.Close(), "Close is idempotent")
	})

	t.Run("MissingTable", func(t *testing.T) {
		t.Parallel()
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			c.Tables.Table = "not_created"
			c.Tables.DeadLetterTable = ""
		})
		_, err := sub.Subscribe(t.Context(), "orders")
		var verr *schema.ValidationError
		require.True(t, errors.As(err, &verr), "got %v", err)
		require.Contains(t, err.Error(), b.Schema+".not_created is missing")
		require.Contains(t, err.Error(), "schema.Create")
	})

	// A closed Subscriber should refuse Subscribe before it touches the
	// database: with AutoInitializeSchema it would otherwise run DDL after
	// Close, and without it the caller gets a schema error instead of
	// ErrSubscriberClosed.
	t.Run("AfterCloseDoesNotTouchTheDatabase", func(t *testing.T) {
		t.Parallel()
		sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			c.Tables.Table = "late"
			c.Tables.DeadLetterTable = ""
			c.AutoInitializeSchema = true
		})
		require.NoError(t, sub.Close())
		_, err := sub.Subscribe(t.Context(), "closed")
		require.ErrorIs(t, err, pgoutbox.ErrSubscriberClosed)
		require.Equal(t, 0, b.count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'late'`, b.Schema),
			"a closed subscriber created tables")

		sub = b.subscriber(t, func(c *pgoutbox.SubscriberConfig) {
			c.Tables.Table = "never"
			c.Tables.DeadLetterTable = ""
		})
		require.NoError(t, sub.Close())
		_, err = sub.Subscribe(t.Context(), "closed")
		require.ErrorIs(t, err, pgoutbox.ErrSubscriberClosed)
	})
}

// Subscribe with a context that is already done says so, instead of
// reporting the schema check it could not run.
func TestSubscribeWithADoneContextSaysSo(t *testing.T) {
	t.Parallel()
	b := setup(t)
	sub := b.subscriber(t, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := sub.Subscribe(ctx, "t")
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorContains(t, err, "the context given is already done")
}

// A dead-letter filter's reason must be one pgoutbox writes: a misspelt one
// matched nothing, and a requeue or purge reported 0 as if there were
// nothing to do. The CLI and the operator page refuse it through this.
func TestDeadLetterFiltersRefuseAReasonThatIsNoFailureReason(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	exec := tx.FromPgxPool(b.Pool)
	_, err := pgoutbox.DeadLetters(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{Reason: "rejcted"})
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	require.ErrorContains(t, err, "use one of max_deliveries, retry_exhausted, rejected, poisoned")
	_, err = pgoutbox.RequeueDeadLettersMatching(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{Reason: "rejcted"})
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	_, err = pgoutbox.PurgeDeadLettersMatching(ctx, exec, b.tables, 0, pgoutbox.DeadLetterFilter{Reason: "rejcted"}, 0)
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	_, err = pgoutbox.RequeueParked(ctx, exec, b.tables, pgoutbox.ParkedFilter{Reason: "rejcted"})
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig)
	page, err := pgoutbox.DeadLetters(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{Reason: pgoutbox.ReasonRejected})
	require.NoError(t, err)
	require.Empty(t, page.Letters)
}

// A publisher on an outbox of an earlier schema version (the service's
// code upgraded before its migration ran) says what to run, whatever the
// column the statement missed.
func TestPublishToAnOutboxOfAnEarlierVersionSaysToMigrate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	old := schema.Config{Schema: b.Schema, Table: "outbox_v3", DeadLetterTable: "outbox_v3_dlq"}
	_, err := schema.Migrate(ctx, tx.FromPgxPool(b.Pool), old, 3)
	require.NoError(t, err)
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: old}, b.logger)
	require.NoError(t, err)

	keyed := newMsg("keyed")
	pgoutbox.WithOrderingKey(keyed, "k1")
	for name, msg := range map[string]*message.Message{"plain": newMsg("plain"), "keyed": keyed} {
		err := pub.Publish("orders", msg)
		if name == "plain" && err == nil {
			continue // nothing of the plain statement is newer than version 3
		}
		require.Error(t, err, name)
		require.Contains(t, err.Error(), "schema version", name)
		require.Contains(t, err.Error(), "pgoutbox schema migrate up", name)
		require.Contains(t, err.Error(), "docs/upgrading.md", name)
	}
}

// A publisher whose Tables name a table of the service's own says it is
// not an outbox, not that it needs a migration.
func TestPublishToATableOfYourOwnSaysItIsNotAnOutbox(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.exec(t, `CREATE TABLE %s.orders (id bigint PRIMARY KEY, item text)`)
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(b.Pool), pgoutbox.PublisherConfig{Tables: schema.Config{Schema: b.Schema, Table: "orders"}}, b.logger)
	require.NoError(t, err)
	err = pub.Publish("orders", newMsg("x"))
	require.Error(t, err)
	require.Contains(t, err.Error(), "it is not an outbox")
	require.Contains(t, err.Error(), "name another table or schema")
	require.NotContains(t, err.Error(), "migrate up")
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.orders`))
}

// Keys, topics and groups at their limits fit the outbox's indexes
// together, however little they compress: a message with both keys on a
// topic of 1024 bytes, stored while nothing was bound, is adopted by a
// group of 1024 bytes and delivered (a longer key made every Subscribe of
// that group fail, and a Publish beside a bound group abort its
// transaction).
func TestKeysTopicsAndGroupsAtTheirLimitsFitTogether(t *testing.T) {
	t.Parallel()
	b := setup(t)
	topic, group := randomKey(1024), randomKey(1024)
	m := newMsg("at the limits")
	pgoutbox.WithDedupKey(m, randomKey(512))
	pgoutbox.WithOrderingKey(m, randomKey(512))
	require.NoError(t, b.poolPublisher(t).Publish(topic, m))
	sub := b.subscriber(t, func(c *pgoutbox.SubscriberConfig) { c.ConsumerGroup = group })
	ch, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	got := receive(t, ch, 10*time.Second)
	require.Equal(t, m.UUID, got.UUID)
	got.Ack()

	bound := newMsg("beside the bound group")
	pgoutbox.WithDedupKey(bound, randomKey(512))
	pgoutbox.WithOrderingKey(bound, randomKey(512))
	require.NoError(t, b.poolPublisher(t).Publish(topic, bound))
	require.Equal(t, bound.UUID, receive(t, ch, 10*time.Second).UUID)
}
