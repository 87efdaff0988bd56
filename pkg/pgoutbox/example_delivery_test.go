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

// ExampleDeliveryOf reads a delivered message's facts: its attempt, which
// grows with each redelivery, and its publish time, which does not. (It
// needs PostgreSQL: POSTGRES_DSN, or the local default.)
func ExampleDeliveryOf() {
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
	tables := schema.Config{Schema: "pgoutbox_example_delivery_" + watermill.NewUUID()[:8]}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		panic(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{tables.Schema}.Sanitize()+" CASCADE") //nolint:errcheck

	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{Tables: tables}, nil)
	if err != nil {
		panic(err)
	}
	if err := pub.Publish("orders.placed", message.NewMessage(watermill.NewUUID(), []byte("order 1"))); err != nil {
		panic(err)
	}
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{
		Tables:      tables,
		RetryPolicy: pgoutbox.ConstantBackoff{Delay: 0, MaxAttempts: 3},
	}, nil)
	if err != nil {
		panic(err)
	}
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, "orders.placed")
	if err != nil {
		panic(err)
	}
	var published time.Time
	for range 2 {
		select {
		case msg := <-msgs:
			d, ok := pgoutbox.DeliveryOf(msg)
			if published.IsZero() {
				published = d.PublishedAt
			}
			fmt.Printf("%s: delivered=%t attempt=%d group=%q same publish time=%t\n",
				msg.Payload, ok, d.Attempt, d.ConsumerGroup, d.PublishedAt.Equal(published))
			if d.Attempt == 1 {
				msg.Nack() // redelivered at once (Delay 0)
			} else {
				msg.Ack()
			}
		case <-time.After(10 * time.Second):
			fmt.Println("timed out")
		}
	}
	// Output:
	// order 1: delivered=true attempt=1 group="" same publish time=true
	// order 1: delivered=true attempt=2 group="" same publish time=true
}
