package pgoutboxtest

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Options tune PubSubWithOptions and NewSchema. The zero value is what
// PubSub uses.
type Options struct {
	// DSN is the database to create the test's schema in. Defaults to the
	// database POSTGRES_DSN names, or Database ("pgoutbox_test", created on
	// first use) when it names none or the server's postgres database, on
	// the server ServerDSN finds. Set it to your own test database when
	// your tests write your tables and the outbox in one transaction and
	// POSTGRES_DSN points elsewhere.
	DSN string

	// Table names the outbox table in the test's schema. Defaults to
	// "outbox".
	Table string
	// DeadLetterTable names the dead-letter table. Defaults to Table +
	// "_dlq".
	DeadLetterTable string
	// NoDeadLetterTable creates no dead-letter table (see
	// schema.Config.NoDeadLetterTable). Defaults to false.
	NoDeadLetterTable bool
	// Rotating makes the outbox a rotating one (see
	// schema.Config.Rotating). Defaults to false.
	Rotating bool
	// Arrivals makes Env's publisher and subscriber use the outbox's
	// arrivals table (see schema.Config.Arrivals). Defaults to false.
	Arrivals bool

	// ConsumerGroup is Env.Subscriber's consumer group. Defaults to "", the
	// default group.
	ConsumerGroup string
	// MaxInFlight is Env.Subscriber's MaxInFlight. Defaults to 1, as in
	// pgoutbox.
	MaxInFlight int
	// Subscriber, when set, changes the configuration of Env.Subscriber and
	// of every Env.NewSubscriber after the test defaults (see
	// Env.SubscriberConfig) and the two fields above were applied.
	Subscriber func(*pgoutbox.SubscriberConfig)

	// MaxConns sizes Env.Pool. Defaults to 10.
	MaxConns int32
	// Logger is given to the publisher and subscribers. Defaults to a
	// no-op logger.
	Logger watermill.LoggerAdapter

	// SkipIfNoDatabase skips the test, instead of failing it, when no
	// PostgreSQL server can be found (see ServerDSN). Defaults to false: a
	// test that needs a database fails without one, with the ways to
	// provide one.
	SkipIfNoDatabase bool
}

func (o Options) tables() schema.Config {
	c := schema.Config{Table: o.Table, DeadLetterTable: o.DeadLetterTable, NoDeadLetterTable: o.NoDeadLetterTable, Rotating: o.Rotating, Arrivals: o.Arrivals}
	if c.Table == "" {
		c.Table = schema.DefaultTable
	}
	if c.DeadLetterTable == "" && !c.NoDeadLetterTable {
		c.DeadLetterTable = c.Table + schema.DefaultDeadLetterSuffix
	}
	return c
}

// Env is one test's Pub/Sub: an outbox in a schema no other running test
// uses, a publisher and a subscriber on it. Everything is closed, and the
// schema emptied for the next test, when the test ends.
type Env struct {
	// DSN is the test database's DSN (without the search_path Pool sets).
	DSN string
	// Schema is the test's schema. Its name is the test's alone: a schema
	// reused by a later test is emptied and renamed first.
	Schema string
	// Tables names the outbox and dead-letter tables in Schema; give it to
	// any pgoutbox publisher or subscriber you build yourself.
	Tables schema.Config
	// Pool is a pool on the test database whose search_path is Schema,
	// public: tables you create without a schema name land in Schema and
	// go away with the test (the schema is then dropped instead of reused,
	// which costs a few milliseconds). Closed when the test ends.
	Pool *pgxpool.Pool
	// Publisher publishes through Pool, each Publish committing on its own.
	// Use TxPublisher to publish in a transaction.
	Publisher *pgoutbox.Publisher
	// Subscriber reads the outbox with the test defaults (see
	// SubscriberConfig). Closed when the test ends.
	Subscriber *pgoutbox.Subscriber
	// Logger is Options.Logger or a no-op logger.
	Logger watermill.LoggerAdapter

	opts Options
	exec tx.Executor // Exec's: the package's assertions given it read Tables
}

// PubSub returns a ready Pub/Sub for the test: PubSubWithOptions with the
// zero Options.
func PubSub(t testing.TB) *Env {
	t.Helper()
	return PubSubWithOptions(t, Options{})
}

// PubSubWithOptions returns a ready Pub/Sub for the test, on an outbox in a
// schema no other running test uses. Schemas are created once per process
// and reused: when the test ends, its subscribers and pool are closed, the
// tables emptied and the schema renamed, and the next test takes it. A schema whose
// shape the test changed (a table, column, index, constraint, function or
// type added or dropped), or whose tables were analyzed (by the test or by
// autovacuum: emptying keeps planner statistics), is dropped instead. Safe with t.Parallel: each
// parallel test gets a schema of its own.
//
// Close every subscriber you build on Env.Tables yourself before the test
// ends (a t.Cleanup registered after PubSub runs first): one still polling
// would take the next test's messages.
func PubSubWithOptions(t testing.TB, o Options) *Env {
	t.Helper()
	if o.Logger == nil {
		o.Logger = watermill.NopLogger{}
	}
	dsn := o.DSN
	if dsn == "" {
		dsn = DSN(t, o.SkipIfNoDatabase)
	}
	d, err := openDatabase(dsn)
	if err != nil {
		t.Fatalf("%v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := d.take(ctx, o.tables())
	if err != nil {
		t.Fatalf("%v", err)
	}
	e := &Env{DSN: dsn, Schema: s.name, Tables: s.tables, Logger: o.Logger, opts: o}
	// Registered first, so it runs last: after the subscribers and the
	// pool registered below are closed.
	t.Cleanup(func() {
		if !d.give(s) {
			t.Logf("pgoutboxtest: schema %s dropped, not reused (the test changed it, or it could not be emptied)", s.name)
		}
	})
	e.Pool = newPool(t, dsn, o.MaxConns, s.name)
	e.exec = tx.FromPgxPool(e.Pool)
	envTables.Store(e.exec, e.Tables)
	t.Cleanup(func() { envTables.Delete(e.exec) })
	e.Publisher = e.TxPublisher(t, e.exec)
	e.Subscriber = e.NewSubscriber(t, nil)
	return e
}

// SubscriberConfig returns the configuration Env.Subscriber was built
// with: the outbox of Tables; Lease 5s; MinPollInterval 10ms;
// MaxPollInterval 500ms (a NOTIFY wakes a subscriber at once anyway);
// DrainTimeout 2s; RetryPolicy ConstantBackoff{Delay: 10ms, MaxAttempts:
// 5}; then Options.ConsumerGroup, Options.MaxInFlight and
// Options.Subscriber. Other fields keep pgoutbox's defaults.
func (e *Env) SubscriberConfig() pgoutbox.SubscriberConfig {
	cfg := pgoutbox.SubscriberConfig{
		Tables:          e.Tables,
		ConsumerGroup:   e.opts.ConsumerGroup,
		MaxInFlight:     e.opts.MaxInFlight,
		Lease:           5 * time.Second,
		MinPollInterval: 10 * time.Millisecond,
		MaxPollInterval: 500 * time.Millisecond,
		DrainTimeout:    2 * time.Second,
		RetryPolicy:     pgoutbox.ConstantBackoff{Delay: 10 * time.Millisecond, MaxAttempts: 5},
	}
	if e.opts.Subscriber != nil {
		e.opts.Subscriber(&cfg)
	}
	return cfg
}

// NewSubscriber returns another subscriber on the test's outbox, closed
// when the test ends: SubscriberConfig, then mod when it is not nil (set
// ConsumerGroup there for a second group, say). It fails the test when
// the configuration is invalid.
func (e *Env) NewSubscriber(t testing.TB, mod func(*pgoutbox.SubscriberConfig)) *pgoutbox.Subscriber {
	t.Helper()
	cfg := e.SubscriberConfig()
	if mod != nil {
		mod(&cfg)
	}
	sub, err := pgoutbox.NewSubscriber(e.Pool, cfg, e.Logger)
	if err != nil {
		t.Fatalf("pgoutboxtest: %v", err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

// TxPublisher returns a publisher on the test's outbox that writes through
// exec: tx.FromPgxTx(tx) or tx.FromSQLTx(tx) to publish in a transaction.
func (e *Env) TxPublisher(t testing.TB, exec tx.Executor) *pgoutbox.Publisher {
	t.Helper()
	pub, err := pgoutbox.NewPublisher(exec, pgoutbox.PublisherConfig{Tables: e.Tables}, e.Logger)
	if err != nil {
		t.Fatalf("pgoutboxtest: %v", err)
	}
	return pub
}

// Exec returns an executor on Pool. The package's assertions given it
// (RequirePublished, RequireNotPublished, RequireScheduled) read the
// test's outbox, Tables, unless InTables names another.
func (e *Env) Exec() tx.Executor { return e.exec }

// LockOutbox takes an ACCESS EXCLUSIVE lock on the test's outbox table, in
// a transaction of a connection of its own, as a migration's ALTER TABLE or
// a VACUUM FULL would, and holds it until the test ends: for tests of what
// health checks, metrics and operator tools do behind such a lock.
func (e *Env) LockOutbox(t testing.TB) {
	t.Helper()
	ctx := context.Background()
	locker, err := pgx.Connect(ctx, e.DSN)
	if err != nil {
		t.Fatalf("pgoutboxtest: connect to lock the outbox: %v", err)
	}
	t.Cleanup(func() { _ = locker.Close(context.Background()) })
	if _, err := locker.Exec(ctx, `BEGIN; LOCK TABLE `+pgx.Identifier{e.Schema, e.Tables.Table}.Sanitize()+` IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatalf("pgoutboxtest: lock the outbox: %v", err)
	}
}

// newPool opens a pool closed when the test ends; with search_path set to
// searchSchema, public when searchSchema is not empty.
func newPool(t testing.TB, dsn string, maxConns int32, searchSchema string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatalf("pgoutboxtest: parse DSN: %v", err)
	}
	if maxConns == 0 {
		maxConns = 10
	}
	cfg.MaxConns = maxConns
	if searchSchema != "" {
		cfg.ConnConfig.RuntimeParams["search_path"] = searchSchema + ", public"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("pgoutboxtest: open pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// Schema is an empty schema of one test's own (see NewSchema).
type Schema struct {
	// DSN is the test database's DSN.
	DSN string
	// Name is the schema's name: RunPrefix and 16 hex digits.
	Name string
	// Pool is a pool on the test database (search_path left as it is),
	// closed when the test ends.
	Pool *pgxpool.Pool
}

// NewSchema creates an empty schema for the test, dropped (CASCADE) when
// the test ends, and never reused: for tests that build their own tables
// or change the outbox's. Options.DSN, MaxConns and SkipIfNoDatabase
// apply; the other fields are ignored. Prefer PubSub, which reuses
// schemas: creating the outbox tables takes tens of milliseconds.
func NewSchema(t testing.TB, o Options) *Schema {
	t.Helper()
	dsn := o.DSN
	if dsn == "" {
		dsn = DSN(t, o.SkipIfNoDatabase)
	}
	d, err := openDatabase(dsn)
	if err != nil {
		t.Fatalf("%v", err)
	}
	name := RunPrefix + strings.ReplaceAll(uuid.NewString(), "-", "")[:16]
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := d.admin.Exec(ctx, `CREATE SCHEMA `+name); err != nil {
		t.Fatalf("pgoutboxtest: create schema: %v", err)
	}
	t.Cleanup(func() {
		if err := d.drop(name); err != nil {
			t.Errorf("pgoutboxtest: drop schema %s: %v", name, err)
		}
	})
	return &Schema{DSN: dsn, Name: name, Pool: newPool(t, dsn, o.MaxConns, "")}
}
