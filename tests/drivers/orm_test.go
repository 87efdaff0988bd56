package drivers_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/stretchr/testify/require"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// publishIn publishes msgs on topic through q, a handle bound to the
// caller's transaction.
func publishIn(t *testing.T, env *pgoutboxtest.Env, q tx.SQLQueryer, topic string, msgs ...*message.Message) error {
	t.Helper()
	pub, err := pgoutbox.NewPublisher(tx.FromSQLQueryer(q), pgoutbox.PublisherConfig{Tables: env.Tables}, nil)
	require.NoError(t, err)
	return pub.Publish(topic, msgs...)
}

func newMessages(payloads ...string) []*message.Message {
	var out []*message.Message
	for _, p := range payloads {
		m := message.NewMessage(watermill.NewUUID(), []byte(p))
		m.Metadata.Set("p", p)
		out = append(out, m)
	}
	return out
}

// GORM's transaction, with prepared statements (its ConnPool is then not
// an *sql.Tx) and without: the domain row and the messages commit
// together, and a transaction the callback fails publishes nothing.
func TestGORMTransactionPublishes(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	ctx := context.Background()
	for _, prepare := range []bool{true, false} {
		db, err := gorm.Open(postgres.Open(env.DSN), &gorm.Config{PrepareStmt: prepare, Logger: logger.Discard})
		require.NoError(t, err)
		sqlDB, err := db.DB()
		require.NoError(t, err)
		t.Cleanup(func() { _ = sqlDB.Close() })
		table := env.Schema + ".orders_gorm"
		require.NoError(t, db.Exec(`CREATE TABLE IF NOT EXISTS `+table+` (id text PRIMARY KEY)`).Error)

		topic := "gorm"
		if prepare {
			topic = "gorm-prepared"
		}
		kept := newMessages("a", "b")
		err = db.WithContext(ctx).Transaction(func(gtx *gorm.DB) error {
			_, isTx := gtx.Statement.ConnPool.(*sql.Tx)
			require.Equal(t, !prepare, isTx, "with PrepareStmt, GORM's handle is not an *sql.Tx")
			if err := gtx.Exec(`INSERT INTO `+table+` VALUES (?)`, topic).Error; err != nil {
				return err
			}
			return publishIn(t, env, gtx.Statement.ConnPool, topic, kept...)
		})
		require.NoError(t, err)
		failed := errors.New("the handler failed")
		err = db.WithContext(ctx).Transaction(func(gtx *gorm.DB) error {
			require.NoError(t, publishIn(t, env, gtx.Statement.ConnPool, topic, newMessages("rolled back")...))
			return failed
		})
		require.ErrorIs(t, err, failed)

		got := env.Drain(t, topic, 2, 20*time.Second)
		require.ElementsMatch(t, []string{kept[0].UUID, kept[1].UUID}, []string{got[0].UUID, got[1].UUID}, "prepared statements: %v", prepare)
		require.ElementsMatch(t, []string{"a", "b"}, []string{got[0].Metadata.Get("p"), got[1].Metadata.Get("p")})
		env.RequireNotPublished(t, env.Exec(), topic) // the rolled-back message never was
		var rows int64
		require.NoError(t, db.Raw(`SELECT count(*) FROM `+table+` WHERE id = ?`, topic).Scan(&rows).Error)
		require.EqualValues(t, 1, rows)
	}
}

// An *sqlx.Tx (here over lib/pq v1.10.9, which refuses Go slices) is a
// SQLQueryer as it is.
func TestSQLXTransactionPublishes(t *testing.T) {
	t.Parallel()
	env := pgoutboxtest.PubSub(t)
	ctx := context.Background()
	db := sqlx.NewDb(libpq(t, env), "postgres")
	stx, err := db.BeginTxx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = stx.Rollback() }()
	msgs := newMessages("x", "y", "z")
	pgoutbox.WithOrderingKey(msgs[2], "k")
	require.NoError(t, publishIn(t, env, stx, "sqlx", msgs...))
	require.NoError(t, stx.Commit())
	got := env.Drain(t, "sqlx", 3, 20*time.Second)
	require.Len(t, got, 3)

	require.ErrorIs(t, publishIn(t, env, stx, "sqlx", newMessages("late")...), tx.ErrTxDone, "a committed transaction says so")
}

// A nil handle, typed or not, is an error that says so, not a panic.
func TestSQLQueryerNil(t *testing.T) {
	env := pgoutboxtest.PubSub(t)
	var none *sqlx.Tx
	err := publishIn(t, env, none, "nil", newMessages("n")...)
	require.ErrorContains(t, err, "nil *sqlx.Tx")
	err = publishIn(t, env, nil, "nil", newMessages("n")...)
	require.ErrorContains(t, err, "FromSQLQueryer was given a nil")
}

// An *sql.DB given as a SQLQueryer (a sqlc DBTX before WithTx) is a pool,
// as FromSQLDB's: not taken for a transaction (InTx), and
// NewContextPublisher takes it (it refused it as "not a transaction").
func TestSQLQueryerGivenAPool(t *testing.T) {
	env := pgoutboxtest.PubSub(t)
	var q tx.SQLQueryer = libpq(t, env)
	exec := tx.FromSQLQueryer(q)
	require.False(t, exec.InTx(), "a pool, not a transaction")
	pub, err := pgoutbox.NewPublisher(exec, pgoutbox.PublisherConfig{Tables: env.Tables}, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish("pooled", newMessages("a")...))
	require.NoError(t, pub.Close())
	_, err = pgoutbox.NewContextPublisher(exec, pgoutbox.PublisherConfig{Tables: env.Tables}, nil)
	require.NoError(t, err, "the pool NewContextPublisher publishes through without a transaction")
	require.Len(t, env.Drain(t, "pooled", 1, 20*time.Second), 1)
}
