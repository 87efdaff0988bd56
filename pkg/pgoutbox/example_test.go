package pgoutbox_test

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// exampleSchema holds the example's tables, a schema of its own per run. It
// is lower case so that psql users can type it unquoted; TestMain
// (main_test.go) checks that the example dropped it.
var exampleSchema = "pgoutbox_example_" + watermill.NewUUID()[:8]

// Example_transactionalOutbox writes a domain change and its message in one
// pgx transaction, then receives the message. A rolled-back transaction
// leaves no message behind. (It needs PostgreSQL: POSTGRES_DSN, or the
// local default, as `make test` provides.)
func Example_transactionalOutbox() {
	ctx := context.Background()
	dsn := os.Getenv("POSTGRES_DSN")
	if dsn == "" {
		dsn = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	tables := schema.Config{Schema: exampleSchema}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		panic(err)
	}
	defer func() {
		// Quoted as schema.Create quotes it, so any name drops what it made.
		if _, err := pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{tables.Schema}.Sanitize()+" CASCADE"); err != nil {
			panic(err)
		}
	}()

	publishInTx := func(payload string, commit bool) {
		pgxTx, err := pool.Begin(ctx)
		if err != nil {
			panic(err)
		}
		// Your domain writes go here, on pgxTx.
		pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgxTx), pgoutbox.PublisherConfig{Tables: tables}, nil)
		if err != nil {
			panic(err)
		}
		if err := pub.Publish("orders.placed", message.NewMessage(watermill.NewUUID(), []byte(payload))); err != nil {
			panic(err)
		}
		if commit {
			err = pgxTx.Commit(ctx)
		} else {
			err = pgxTx.Rollback(ctx)
		}
		if err != nil {
			panic(err)
		}
	}
	publishInTx("order 1", true)
	publishInTx("order 2", false) // rolled back: never delivered
	publishInTx("order 3", true)

	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: tables}, nil)
	if err != nil {
		panic(err)
	}
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, "orders.placed")
	if err != nil {
		panic(err)
	}
	for range 2 {
		select {
		case msg := <-msgs:
			fmt.Println(string(msg.Payload))
			msg.Ack()
		case <-time.After(10 * time.Second):
			fmt.Println("timed out")
		}
	}
	// Output:
	// order 1
	// order 3
}
