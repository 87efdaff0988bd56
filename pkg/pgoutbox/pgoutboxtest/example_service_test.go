package pgoutboxtest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// OrderPlaced is the event the service publishes.
type OrderPlaced struct {
	OrderID int    `json:"order_id"`
	Item    string `json:"item"`
}

// Orders is the service under test: it writes an order and its event in one
// transaction.
type Orders struct {
	Pool   *pgxpool.Pool
	Tables schema.Config
}

func (s Orders) Place(ctx context.Context, id int, item string) error {
	pgxTx, err := s.Pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = pgxTx.Rollback(ctx) }()
	if _, err := pgxTx.Exec(ctx, `INSERT INTO orders (id, item) VALUES ($1, $2)`, id, item); err != nil {
		return err
	}
	pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgxTx), pgoutbox.PublisherConfig{Tables: s.Tables}, nil)
	if err != nil {
		return err
	}
	payload, _ := json.Marshal(OrderPlaced{OrderID: id, Item: item})
	if err := pub.Publish("orders.placed", message.NewMessage(watermill.NewUUID(), payload)); err != nil {
		return err
	}
	return pgxTx.Commit(ctx)
}

// testPlaceOrder checks that placing an order published its event, and
// that a failed write published nothing.
func testPlaceOrder(t testing.TB) {
	ctx := context.Background()
	env := pgoutboxtest.PubSub(t)
	// Env.Pool's search_path is the test's schema: this table is the test's
	// own, dropped with the schema when the test ends.
	_, err := env.Pool.Exec(ctx, `CREATE TABLE orders (id int PRIMARY KEY, item text NOT NULL)`)
	require.NoError(t, err)
	orders := Orders{Pool: env.Pool, Tables: env.Tables}

	require.NoError(t, orders.Place(ctx, 42, "book"))
	msgs := env.RequirePublished(t, env.Exec(), "orders.placed",
		pgoutboxtest.WithJSONPayload(OrderPlaced{OrderID: 42, Item: "book"}), pgoutboxtest.Count(1))
	fmt.Println("published:", string(msgs[0].Payload))

	require.Error(t, orders.Place(ctx, 42, "pen"), "the order exists")
	env.RequireNotPublished(t, env.Exec(), "orders.placed", pgoutboxtest.WithJSONPayload(OrderPlaced{OrderID: 42, Item: "pen"}))
	fmt.Println("nothing published for the failed order")
}

// Example_serviceTest tests that a service's order write published its
// event, in the same transaction.
func Example_serviceTest() {
	runTest(testPlaceOrder) // in your code: func TestPlaceOrder(t *testing.T)
	// Output:
	// published: {"order_id":42,"item":"book"}
	// nothing published for the failed order
}
