package tests

import (
	"context"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// loginRole creates a login role with a unique name (roles are global to
// the cluster), runs grants (each "%s" is the test schema, "%r" the role),
// and returns a pool connected as that role. The role is dropped, with its
// privileges, when the test ends, after the pool is closed.
func (b *bundle) loginRole(t *testing.T, kind string, grants ...string) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	role := "pgoutbox_" + kind + "_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:12]
	_, err := b.Pool.Exec(ctx, `CREATE ROLE `+role+` LOGIN`)
	require.NoError(t, err)
	t.Cleanup(func() {
		// DROP OWNED revokes the role's privileges in this database.
		if _, err := b.Pool.Exec(context.Background(), `DROP OWNED BY `+role); err != nil {
			t.Logf("drop owned by %s: %v", role, err)
		}
		if _, err := b.Pool.Exec(context.Background(), `DROP ROLE `+role); err != nil {
			t.Logf("drop role %s: %v", role, err)
		}
	})
	for _, g := range grants {
		_, err := b.Pool.Exec(ctx, strings.NewReplacer("%s", b.Schema, "%r", role).Replace(g))
		require.NoError(t, err, g)
	}
	u, err := url.Parse(b.DSN)
	require.NoError(t, err)
	u.User = url.User(role)
	q := u.Query()
	q.Set("pool_max_conns", "4")
	u.RawQuery = q.Encode()
	pool, err := pgxpool.New(context.Background(), u.String())
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// publisherGrants and subscriberGrants are the grants docs/operations.md
// (Least privilege) gives a publisher and a subscriber role.
var (
	publisherGrants = []string{
		`GRANT USAGE ON SCHEMA %s TO %r`,
		`GRANT INSERT ON %s.outbox TO %r`,
		`GRANT SELECT (id, uuid, available_at, topic, consumer_group, dedup_key) ON %s.outbox TO %r`,
		`GRANT SELECT ON %s.outbox_bindings TO %r`,
	}
	subscriberGrants = []string{
		`GRANT USAGE ON SCHEMA %s TO %r`,
		`GRANT SELECT, UPDATE, DELETE ON %s.outbox TO %r`,
		`GRANT SELECT, INSERT ON %s.outbox_bindings TO %r`,
		`GRANT SELECT, INSERT ON %s.outbox_dlq TO %r`,
		`GRANT SELECT ON %s.outbox_paused TO %r`,
	}
)

// The GRANTs the README (Operations) documents are enough: a publisher
// role publishes (plain, scheduled and keyed messages), a subscriber role
// consumes, binds its group, dead-letters and runs the operator functions,
// and neither can do more than its job.
func TestLeastPrivilegeRoles(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pubPool := b.loginRole(t, "pub", publisherGrants...)
	subPool := b.loginRole(t, "sub", subscriberGrants...)

	sub, err := pgoutbox.NewSubscriber(subPool, pgoutbox.SubscriberConfig{
		Tables: b.tables, ConsumerGroup: "billing", MinPollInterval: 20 * time.Millisecond, MaxPollInterval: time.Second,
		DrainTimeout: 2 * time.Second, RetryPolicy: pgoutbox.NoRetry(),
	}, b.logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	ch, err := sub.Subscribe(ctx, "orders")
	require.NoError(t, err)

	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pubPool), pgoutbox.PublisherConfig{Tables: b.tables}, b.logger)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("orders", newMsg("plain")))
	keyed := newMsg("keyed")
	pgoutbox.WithDedupKey(keyed, "k1")
	res, err := pub.PublishWithResult("orders", keyed)
	require.NoError(t, err)
	require.NotZero(t, res.IDs[0])
	again := newMsg("keyed again")
	pgoutbox.WithDedupKey(again, "k1")
	res, err = pub.PublishWithResult("orders", again)
	require.NoError(t, err)
	require.Equal(t, []int{0}, res.Skipped())
	later := newMsg("later")
	pgoutbox.DeliverAfter(later, time.Hour)
	require.NoError(t, pub.Publish("orders", later))
	pgTx, err := pubPool.Begin(ctx)
	require.NoError(t, err)
	txPub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgTx), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	require.NoError(t, txPub.Publish("orders", newMsg("in tx"), newMsg("in tx 2")))
	require.NoError(t, pgTx.Commit(ctx))

	got := map[string]bool{}
	for range 4 {
		m := receive(t, ch, 10*time.Second)
		got[string(m.Payload)] = true
		if string(m.Payload) == "in tx 2" {
			m.Nack() // NoRetry: dead-lettered by the subscriber role
		} else {
			m.Ack()
		}
	}
	require.Equal(t, map[string]bool{"plain": true, "keyed": true, "in tx": true, "in tx 2": true}, got)
	require.Eventually(t, func() bool {
		return b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox_dlq`) == 1
	}, 10*time.Second, 20*time.Millisecond)

	// The operator functions, as the subscriber role.
	subExec := tx.FromPgxPool(subPool)
	stats, err := pgoutbox.Stats(ctx, subExec, b.tables, pgoutbox.StatsForGroup("orders", "billing"))
	require.NoError(t, err)
	require.EqualValues(t, 1, stats[0].Scheduled)
	require.Equal(t, map[string]int64{"retry_exhausted": 1}, stats[0].DeadLetters)
	page, err := pgoutbox.DeadLetters(ctx, subExec, b.tables, pgoutbox.DeadLetterFilter{Topic: "orders"})
	require.NoError(t, err)
	require.Len(t, page.Letters, 1)
	_, err = pgoutbox.Peek(ctx, subExec, b.tables, "orders", "billing", 10)
	require.NoError(t, err)

	// Neither role can do more than its job.
	denied := func(pool *pgxpool.Pool, stmt string) {
		t.Helper()
		_, err := pool.Exec(ctx, fmt.Sprintf(stmt, b.Schema))
		require.Error(t, err, stmt)
		require.Regexp(t, `permission denied|must be owner`, err.Error(), stmt)
	}
	denied(pubPool, `SELECT payload FROM %s.outbox`)
	denied(pubPool, `SELECT * FROM %s.outbox`)
	denied(pubPool, `DELETE FROM %s.outbox`)
	denied(pubPool, `UPDATE %s.outbox SET deliveries = 0`)
	denied(pubPool, `SELECT * FROM %s.outbox_dlq`)
	denied(subPool, `ALTER TABLE %s.outbox ADD COLUMN x int`)
	denied(subPool, `DROP TABLE %s.outbox`)
	denied(subPool, `DROP TABLE %s.outbox_dlq`)
	denied(subPool, `TRUNCATE %s.outbox`)
	denied(subPool, `DELETE FROM %s.outbox_dlq`)
}

// Topics and consumer groups travel as parameters: a name that looks like
// SQL is only a name. The message is delivered and the tables survive.
func TestInjectionLikeNames(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	const topic = `x'); DROP TABLE outbox; --`
	const group = `g"; DROP TABLE outbox_dlq; --`
	sub := b.groupSubscriber(t, group, nil)
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	pub := b.poolPublisher(t)
	keyed := newMsg("hello")
	pgoutbox.WithDedupKey(keyed, `k'; DELETE FROM outbox; --`)
	require.NoError(t, pub.Publish(topic, keyed))
	m := receive(t, ch, 10*time.Second)
	require.Equal(t, "hello", string(m.Payload))
	m.Ack()

	exec := tx.FromPgxPool(b.Pool)
	s, err := pgoutbox.Stats(ctx, exec, b.tables, pgoutbox.StatsForGroup(topic, group))
	require.NoError(t, err)
	require.Len(t, s, 1)
	_, err = pgoutbox.Peek(ctx, exec, b.tables, topic, group, 1)
	require.NoError(t, err)
	_, err = pgoutbox.DeadLetters(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{Topic: topic, ConsumerGroup: new(group), Reason: pgoutbox.ReasonRejected})
	require.NoError(t, err)
	_, err = pgoutbox.DeadLetters(ctx, exec, b.tables, pgoutbox.DeadLetterFilter{Topic: topic, ConsumerGroup: new(group), Reason: `'; --`})
	require.ErrorIs(t, err, pgoutbox.ErrInvalidConfig, "a reason that is no failure reason is refused before any SQL")
	_, err = pgoutbox.Unbind(ctx, exec, b.tables, topic, group, true)
	require.NoError(t, err)
	for _, tbl := range []string{"outbox", "outbox_dlq", "outbox_bindings"} {
		require.Equal(t, 1, b.count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = $2`, b.Schema, tbl), tbl)
	}
}

// A subscriber role with the documented grants binds a second group to a
// topic whose default group has messages waiting: those are the default
// group's own, nothing is copied, so no INSERT is needed (it failed with
// "permission denied for table outbox" while the default group had rows).
// With the documented extras it requeues dead letters and purges them.
func TestLeastPrivilegeSecondGroupAndDeadLetterTools(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	subPool := b.loginRole(t, "sub", append(subscriberGrants,
		`GRANT UPDATE, DELETE ON %s.outbox_dlq TO %r`, `GRANT INSERT ON %s.outbox TO %r`)...)
	narrow := b.loginRole(t, "sub", subscriberGrants...)
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(narrow), b.tables, "orders", ""))
	b.publishInTx(t, "orders", true, newMsgs(3)...)
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(narrow), b.tables, "orders", "billing"),
		"the default group's waiting messages need no copy")
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE consumer_group = ''`))
	require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.Schema+`.outbox WHERE consumer_group = 'billing'`))

	_, err := b.Pool.Exec(ctx, `INSERT INTO `+b.Schema+`.outbox_dlq (id, topic, consumer_group, uuid, payload, metadata, created_at, deliveries, failure_reason)
		SELECT id, topic, consumer_group, uuid, payload, metadata, created_at, 1, 'rejected' FROM `+b.Schema+`.outbox;
		DELETE FROM `+b.Schema+`.outbox`)
	require.NoError(t, err)
	var ids []int64
	require.NoError(t, b.Pool.QueryRow(ctx, `SELECT array_agg(id ORDER BY id) FROM `+b.Schema+`.outbox_dlq`).Scan(&ids))
	require.Len(t, ids, 3)
	n, err := pgoutbox.RequeueDeadLetters(ctx, tx.FromPgxPool(subPool), b.tables, ids[:1])
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	n, err = pgoutbox.RequeueDeadLettersMatching(ctx, tx.FromPgxPool(subPool), b.tables, pgoutbox.DeadLetterFilter{Topic: "orders", Limit: 1})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	n, err = pgoutbox.DeleteDeadLetters(ctx, tx.FromPgxPool(subPool), b.tables, ids[2:])
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	require.Equal(t, 2, b.outboxRows(t, "orders"))
}

// CancelScheduled deletes rows: a publisher role cancels with the grant
// docs/timers.md names, and without it gets an error that names the
// grant, not a publish error.
func TestCancelScheduledWithTheDocumentedGrant(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pubPool := b.loginRole(t, "pub", publisherGrants...)
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pubPool), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	later := newMsg("later")
	pgoutbox.DeliverAfter(later, time.Hour)
	pgoutbox.WithDedupKey(later, "remind-1")
	require.NoError(t, pub.Publish("orders", later))

	_, err = pub.CancelScheduled(ctx, "orders", "remind-1")
	require.ErrorContains(t, err, `pgoutbox: cancel scheduled messages of "orders": the role may not delete`)
	require.ErrorContains(t, err, "grant it DELETE")

	canceller := b.loginRole(t, "canceller", append(publisherGrants,
		`GRANT DELETE, SELECT (lease_token) ON %s.outbox TO %r`)...)
	pub, err = pgoutbox.NewPublisher(tx.FromPgxPool(canceller), pgoutbox.PublisherConfig{Tables: b.tables}, nil)
	require.NoError(t, err)
	ok, err := pub.CancelScheduled(ctx, "orders", "remind-1")
	require.NoError(t, err)
	require.True(t, ok)
	require.Zero(t, b.outboxRows(t, "orders"))
}

// RenameGroup with the grants docs/consumer-groups.md names on top of a
// subscriber's, and without them an error that says which table.
func TestRenameGroupWithTheDocumentedGrants(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	require.NoError(t, pgoutbox.Bind(ctx, tx.FromPgxPool(b.Pool), b.tables, "orders", "billing"))
	require.NoError(t, pgoutbox.PauseGroup(ctx, tx.FromPgxPool(b.Pool), b.tables, "orders", "billing"))
	b.publishInTx(t, "orders", true, newMsgs(2)...)
	narrow := b.loginRole(t, "sub", subscriberGrants...)
	_, err := pgoutbox.RenameGroup(ctx, tx.FromPgxPool(narrow), b.tables, "orders", "billing", "invoicing")
	require.ErrorContains(t, err, "permission denied")
	renamer := b.loginRole(t, "renamer", append(subscriberGrants,
		`GRANT UPDATE ON %s.outbox_bindings, %s.outbox_dlq TO %r`, `GRANT UPDATE, DELETE ON %s.outbox_paused TO %r`)...)
	moved, err := pgoutbox.RenameGroup(ctx, tx.FromPgxPool(renamer), b.tables, "orders", "billing", "invoicing")
	require.NoError(t, err)
	require.EqualValues(t, 2, moved)
	require.True(t, b.statsOf(t, "orders", "invoicing").Paused)
}

// A migration role that owns the schema a DBA made for it, and may not
// create schemas in the database, creates and migrates the outbox there:
// PostgreSQL checks the right to create schemas before it looks whether
// the schema exists, so a bare CREATE SCHEMA IF NOT EXISTS failed on the
// first statement of every path (Create, Migrate, the migration files).
func TestAMigrationRoleThatOwnsItsSchemaCreatesTheOutbox(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	created, migrated := "made_"+b.Schema, "migrated_"+b.Schema
	pool := b.loginRole(t, "migrator",
		`CREATE SCHEMA `+created+` AUTHORIZATION %r`,
		`CREATE SCHEMA `+migrated+` AUTHORIZATION %r`)
	var mayCreate bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT has_database_privilege(current_database(), 'CREATE')`).Scan(&mayCreate))
	require.False(t, mayCreate, "the role may not create schemas")

	exec := tx.FromPgxPool(pool)
	c := schema.Config{Schema: created, Table: "outbox", DeadLetterTable: "outbox_dlq"}
	require.NoError(t, schema.Create(ctx, exec, c))
	require.NoError(t, schema.Create(ctx, exec, c), "again: it is idempotent")
	require.NoError(t, schema.Validate(ctx, exec, c))

	c.Schema = migrated
	_, err := schema.Migrate(ctx, exec, c, schema.Latest)
	require.NoError(t, err)
	require.NoError(t, schema.Validate(ctx, exec, c))
}

// AutoInitializeSchema on a role without CREATE: an up-to-date outbox
// needs nothing created, so Create runs no DDL and Subscribe goes on,
// where it failed with a bare "permission denied for schema"; when it
// cannot tell (the version table unreadable), the error says what the
// option needs.
func TestAutoInitializeSchemaWithoutCreateOnAnUpToDateOutbox(t *testing.T) {
	t.Parallel()
	b := setup(t)
	subscribe := func(pool *pgxpool.Pool) error {
		sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: b.tables, AutoInitializeSchema: true}, b.logger)
		require.NoError(t, err)
		defer func() { _ = sub.Close() }()
		return sub.SubscribeInitialize("orders")
	}
	reading := b.loginRole(t, "autoinit", append(slices.Clone(subscriberGrants), `GRANT SELECT ON %s.outbox_schema_version TO %r`)...)
	require.NoError(t, subscribe(reading))
	blind := b.loginRole(t, "autoinit", subscriberGrants...)
	err := subscribe(blind)
	require.ErrorContains(t, err, "permission denied")
	require.ErrorContains(t, err, "unset AutoInitializeSchema")
}

// A role at its CONNECTION LIMIT does not fail Subscribe while the pool's
// own connection is busy: pgxpool fails an Acquire at once when the server
// refuses it another connection, and a Router's start failed with it,
// while the busy connection came free a moment later.
func TestSubscribeWaitsForAConnectionTheRolesLimitHoldsBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	pool := b.loginRole(t, "limited", append(slices.Clone(subscriberGrants), `ALTER ROLE %r CONNECTION LIMIT 1`)...)
	busy, err := pool.Acquire(ctx) // the role's one connection
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `SELECT 1`) // the server refuses a second
	require.ErrorContains(t, err, "53300")
	go func() {
		time.Sleep(50 * time.Millisecond) // a handler's query that ends
		busy.Release()
	}()
	sub := b.subscriberOn(t, pool, nil)
	_, err = sub.Subscribe(ctx, "t")
	require.NoError(t, err)
}
