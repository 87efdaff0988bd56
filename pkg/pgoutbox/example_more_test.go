package pgoutbox_test

import (
	"context"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// exampleOutbox creates an outbox in a schema of its own and returns a
// pool and its tables; drop removes the schema.
func exampleOutbox(suffix string) (pool *pgxpool.Pool, tables schema.Config, drop func()) {
	ctx := context.Background()
	dsn := os.Getenv("POSTGRES_DSN")
	if dsn == "" {
		dsn = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		panic(err)
	}
	tables = schema.Config{Schema: exampleSchema + "_" + suffix}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		panic(err)
	}
	return pool, tables, func() {
		if _, err := pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{tables.Schema}.Sanitize()+" CASCADE"); err != nil {
			panic(err)
		}
		pool.Close()
	}
}

// Example_orderingKeys delivers the events of each order in publish order
// while the orders run in parallel (MaxInFlight 8): a key comes from the
// publisher's GenerateOrderingKey or from WithOrderingKey.
func Example_orderingKeys() {
	ctx := context.Background()
	pool, tables, drop := exampleOutbox("ordering")
	defer drop()

	// Every message's key is its order id, like a Kafka partition key.
	pub, err := pgoutbox.NewPublisher(tx.FromPgxPool(pool), pgoutbox.PublisherConfig{
		Tables: tables,
		GenerateOrderingKey: func(topic string, msg *message.Message) (string, error) {
			return msg.Metadata.Get("order_id"), nil
		},
	}, nil)
	if err != nil {
		panic(err)
	}
	for _, ev := range []string{"order-1 created", "order-2 created", "order-1 paid", "order-1 shipped", "order-2 paid"} {
		id, _, _ := strings.Cut(ev, " ")
		msg := message.NewMessage(watermill.NewUUID(), []byte(ev))
		msg.Metadata.Set("order_id", id)
		if err := pub.Publish("orders", msg); err != nil {
			panic(err)
		}
	}
	// Or per message: a key set with WithOrderingKey wins over the
	// generated one.
	late := message.NewMessage(watermill.NewUUID(), []byte("order-2 shipped"))
	pgoutbox.WithOrderingKey(late, "order-2")
	if err := pub.Publish("orders", late); err != nil {
		panic(err)
	}

	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: tables, MaxInFlight: 8}, nil)
	if err != nil {
		panic(err)
	}
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, "orders")
	if err != nil {
		panic(err)
	}
	byKey := map[string][]string{}
	for range 6 {
		select {
		case msg := <-msgs:
			key := msg.Metadata.Get(pgoutbox.OrderingKeyMetadataKey)
			_, event, _ := strings.Cut(string(msg.Payload), " ")
			byKey[key] = append(byKey[key], event)
			msg.Ack()
		case <-time.After(10 * time.Second):
			fmt.Println("timed out")
			return
		}
	}
	for _, key := range slices.Sorted(maps.Keys(byKey)) {
		fmt.Println(key, byKey[key])
	}
	// Output:
	// order-1 [created paid shipped]
	// order-2 [created paid shipped]
}

// Example_deadLetters rejects a message, finds it in the dead-letter table
// with its reason and error, and requeues it once the cause is fixed: it
// is delivered again, to the group that failed it.
func Example_deadLetters() {
	ctx := context.Background()
	pool, tables, drop := exampleOutbox("dlq")
	defer drop()
	exec := tx.FromPgxPool(pool)

	pub, err := pgoutbox.NewPublisher(exec, pgoutbox.PublisherConfig{Tables: tables}, nil)
	if err != nil {
		panic(err)
	}
	if err := pub.Publish("orders.placed", message.NewMessage(watermill.NewUUID(), []byte(`{"order_id":42}`))); err != nil {
		panic(err)
	}
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: tables}, nil)
	if err != nil {
		panic(err)
	}
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, "orders.placed")
	if err != nil {
		panic(err)
	}
	receive := func() *message.Message {
		select {
		case msg := <-msgs:
			return msg
		case <-time.After(10 * time.Second):
			panic("timed out")
		}
	}
	msg := receive()
	_ = pgoutbox.Reject(msg, "unknown customer") // what a handler returns; the Router then nacks
	msg.Nack()

	// What failed, and why: pages of 100 (Limit, up to 10,000), oldest failure first.
	var page pgoutbox.DeadLetterPage
	for deadline := time.Now().Add(10 * time.Second); len(page.Letters) == 0 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		page, err = pgoutbox.DeadLetters(ctx, exec, tables, pgoutbox.DeadLetterFilter{Topic: "orders.placed", Reason: "rejected"})
		if err != nil {
			panic(err)
		}
	}
	dl := page.Letters[0]
	fmt.Printf("dead letter: %s %s (%s) after %d delivery\n", dl.Payload, dl.FailureReason, dl.LastError, dl.Deliveries)

	// Redrive: back into the outbox, due at once, deliveries reset.
	n, err := pgoutbox.RequeueDeadLetters(ctx, exec, tables, []int64{dl.ID})
	if err != nil {
		panic(err)
	}
	fmt.Println("requeued:", n)
	again := receive()
	fmt.Println("delivered again:", string(again.Payload))
	again.Ack()
	// Output:
	// dead letter: {"order_id":42} rejected (rejected: unknown customer) after 1 delivery
	// requeued: 1
	// delivered again: {"order_id":42}
}
