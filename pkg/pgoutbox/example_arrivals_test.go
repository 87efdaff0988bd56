package pgoutbox_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Example_arrivals gives an existing outbox an arrivals table, where plain
// messages arrive without a lookup of the topic's consumer groups, and
// consumes them as usual: every publisher's and subscriber's Tables say
// Arrivals.
func Example_arrivals() {
	ctx := context.Background()
	pool, tables, drop := exampleOutbox("arrivals")
	defer drop()

	tables.Arrivals = true // in schema.Create and in every publisher's and subscriber's Tables
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		panic(err)
	}
	pgxTx, err := pool.Begin(ctx)
	if err != nil {
		panic(err)
	}
	pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgxTx), pgoutbox.PublisherConfig{Tables: tables}, nil)
	if err != nil {
		panic(err)
	}
	if err := pub.Publish("orders.placed", message.NewMessage(watermill.NewUUID(), []byte("order 1"))); err != nil {
		panic(err)
	}
	if err := pgxTx.Commit(ctx); err != nil {
		panic(err)
	}
	var arrived int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+tables.Schema+`.outbox_arrivals`).Scan(&arrived); err != nil {
		panic(err)
	}
	fmt.Println("arrivals:", arrived)

	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: tables}, nil)
	if err != nil {
		panic(err)
	}
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, "orders.placed")
	if err != nil {
		panic(err)
	}
	select {
	case msg := <-msgs:
		fmt.Println(string(msg.Payload))
		msg.Ack()
	case <-time.After(10 * time.Second):
		fmt.Println("timed out")
	}
	// Output:
	// arrivals: 1
	// order 1
}
