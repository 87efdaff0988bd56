// HTTP-service is the outbox in a web service: POST /orders inserts an
// order, publishes OrderPlaced with a publisher bound to the request's pgx
// transaction, then reserves stock; an order that is out of stock rolls
// the whole transaction back, its message with it. A Router consumes
// OrderPlaced, and exactly the committed orders arrive.
//
//	POSTGRES_DSN=postgres://... go run ./_examples/http-service
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

const topic = "orders.placed"

// PlaceOrder is the body of POST /orders.
type PlaceOrder struct {
	Item     string `json:"item"`
	Quantity int    `json:"quantity"`
}

// OrderPlaced is the message published for each stored order.
type OrderPlaced struct {
	OrderID  int64  `json:"order_id"`
	Item     string `json:"item"`
	Quantity int    `json:"quantity"`
}

// errOutOfStock fails an order after it was written: its transaction
// rolls back.
var errOutOfStock = errors.New("out of stock")

// service holds what the HTTP handler needs.
type service struct {
	pool   *pgxpool.Pool
	tables schema.Config
	sch    string // the quoted schema of the example's tables
}

func main() {
	if err := run(); err != nil {
		log.Fatalf("http-service example failed: %v", err)
	}
}

func run() error {
	ctx := context.Background()
	dsn := os.Getenv("POSTGRES_DSN")
	if dsn == "" {
		dsn = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	tables := schema.Config{Schema: "pgoutbox_http_example", Table: "outbox"}
	sch := pgx.Identifier{tables.Schema}.Sanitize()
	if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+sch+` CASCADE`); err != nil {
		return err
	}
	if err := schema.Create(ctx, tx.FromPgxPool(pool), tables); err != nil {
		return err
	}
	defer pool.Exec(context.Background(), `DROP SCHEMA `+sch+` CASCADE`) //nolint:errcheck
	if _, err := pool.Exec(ctx, `
		CREATE TABLE `+sch+`.orders (id bigserial PRIMARY KEY, item text NOT NULL, quantity int NOT NULL);
		CREATE TABLE `+sch+`.stock (item text PRIMARY KEY, available int NOT NULL CHECK (available >= 0));
		INSERT INTO `+sch+`.stock VALUES ('espresso machine', 5), ('grinder', 1)`); err != nil {
		return err
	}

	// The consumer: a Router with a pgoutbox subscriber.
	logger := watermill.NopLogger{}
	sub, err := pgoutbox.NewSubscriber(pool, pgoutbox.SubscriberConfig{Tables: tables}, logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 40 * time.Second}, logger)
	if err != nil {
		return err
	}
	consumed := make(chan int64, 10)
	router.AddConsumerHandler("send_confirmation", topic, sub, func(msg *message.Message) error {
		var ev OrderPlaced
		if err := json.Unmarshal(msg.Payload, &ev); err != nil {
			return pgoutbox.Reject(msg, "payload is not an OrderPlaced event")
		}
		fmt.Printf("consumer: OrderPlaced order_id=%d %dx %s\n", ev.OrderID, ev.Quantity, ev.Item)
		consumed <- ev.OrderID
		return nil
	})
	routerErr := make(chan error, 1)
	go func() { routerErr <- router.Run(ctx) }()
	<-router.Running()

	// The service.
	svc := &service{pool: pool, tables: tables, sch: sch}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", svc.placeOrder)
	server := httptest.NewServer(mux)
	defer server.Close()

	var committed []int64
	for _, o := range []PlaceOrder{
		{"espresso machine", 2},
		{"grinder", 1},
		{"grinder", 1}, // the last grinder is gone: 409, rolled back
		{"espresso machine", 1},
	} {
		id, status, err := post(server.URL+"/orders", o)
		if err != nil {
			return err
		}
		note := ""
		if status == http.StatusConflict {
			note = " (out of stock: the order and its message rolled back)"
		}
		fmt.Printf("client:   POST /orders %dx %s -> %d%s\n", o.Quantity, o.Item, status, note)
		switch {
		case status == http.StatusCreated:
			committed = append(committed, id)
		case status == http.StatusConflict && o.Item == "grinder":
		default:
			return fmt.Errorf("POST /orders %+v answered %d", o, status)
		}
	}
	if len(committed) != 3 {
		return fmt.Errorf("%d orders committed, want 3", len(committed))
	}

	// Exactly the committed orders arrive: wait for them, then check that
	// no other message exists.
	var got []int64
	timeout := time.After(10 * time.Second)
	for len(got) < len(committed) {
		select {
		case id := <-consumed:
			got = append(got, id)
		case err := <-routerErr:
			return fmt.Errorf("router stopped: %v", err)
		case <-timeout:
			return fmt.Errorf("timed out: consumed %v, want %v", got, committed)
		}
	}
	if err := router.Close(); err != nil {
		return err
	}
	if err := <-routerErr; err != nil {
		return err
	}
	slices.Sort(got)
	if !slices.Equal(got, committed) {
		return fmt.Errorf("consumed orders %v, want %v", got, committed)
	}
	rows, err := pool.Query(ctx, `SELECT id FROM `+sch+`.orders ORDER BY id`)
	if err != nil {
		return err
	}
	orders, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return err
	}
	if !slices.Equal(orders, committed) {
		return fmt.Errorf("orders table holds %v, want %v", orders, committed)
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{tables.Schema, tables.Table}.Sanitize()).Scan(&left); err != nil {
		return err
	}
	if left != 0 {
		return fmt.Errorf("%d message(s) left in the outbox, want 0", left)
	}
	fmt.Printf("orders %v committed and consumed; the rejected order left no row and no message\n", committed)
	return nil
}

// placeOrder handles POST /orders: the order, its OrderPlaced message and
// the stock reservation commit together, or none of them does.
func (s *service) placeOrder(w http.ResponseWriter, r *http.Request) {
	var req PlaceOrder
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.Item == "" || req.Quantity <= 0 {
		http.Error(w, "want {\"item\": ..., \"quantity\": > 0}", http.StatusBadRequest)
		return
	}
	id, err := s.storeOrder(r.Context(), req)
	switch {
	case errors.Is(err, errOutOfStock):
		http.Error(w, err.Error(), http.StatusConflict)
		return
	case err != nil:
		http.Error(w, "cannot place the order", http.StatusInternalServerError)
		log.Printf("POST /orders: %v", err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(map[string]int64{"id": id})
}

func (s *service) storeOrder(ctx context.Context, req PlaceOrder) (int64, error) {
	pgTx, err := s.pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer pgTx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after Commit

	var id int64
	if err := pgTx.QueryRow(ctx, `INSERT INTO `+s.sch+`.orders (item, quantity) VALUES ($1, $2) RETURNING id`,
		req.Item, req.Quantity).Scan(&id); err != nil {
		return 0, err
	}
	// A publisher is cheap: one per transaction, bound to it.
	pub, err := pgoutbox.NewPublisher(tx.FromPgxTx(pgTx), pgoutbox.PublisherConfig{Tables: s.tables}, nil)
	if err != nil {
		return 0, err
	}
	payload, err := json.Marshal(OrderPlaced{OrderID: id, Item: req.Item, Quantity: req.Quantity})
	if err != nil {
		return 0, err
	}
	msg := message.NewMessage(watermill.NewUUID(), payload)
	msg.SetContext(ctx)
	if err := pub.Publish(topic, msg); err != nil {
		return 0, err
	}
	// Checked last on purpose: by now the order and its message are
	// written, and the rollback takes both back.
	tag, err := pgTx.Exec(ctx, `UPDATE `+s.sch+`.stock SET available = available - $2 WHERE item = $1 AND available >= $2`,
		req.Item, req.Quantity)
	if err != nil {
		return 0, err
	}
	if tag.RowsAffected() == 0 {
		return 0, fmt.Errorf("%w: %dx %s", errOutOfStock, req.Quantity, req.Item)
	}
	return id, pgTx.Commit(ctx)
}

// post sends a PlaceOrder and returns the new order's id (on 201) and the
// status code.
func post(url string, o PlaceOrder) (int64, int, error) {
	body, err := json.Marshal(o)
	if err != nil {
		return 0, 0, err
	}
	resp, err := http.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		return 0, resp.StatusCode, nil
	}
	var created struct {
		ID int64 `json:"id"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&created); err != nil {
		return 0, 0, err
	}
	return created.ID, resp.StatusCode, nil
}
