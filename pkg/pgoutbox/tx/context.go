package tx

import (
	"context"
	"database/sql"

	"github.com/jackc/pgx/v5"
)

type executorKey struct{}

// WithExecutor returns ctx carrying e, a transaction-bound Executor.
// Publishers built with pgoutbox.NewContextPublisher publish in it when
// given a message with that context; Middleware does this for every
// message a handler processes. Use it where you begin a transaction
// yourself (an HTTP handler, say) and publish through a CQRS bus or
// another component that was built once with a context publisher.
func WithExecutor(ctx context.Context, e Executor) context.Context {
	return context.WithValue(ctx, executorKey{}, e)
}

// ExecutorFromContext returns the transaction-bound Executor ctx carries.
func ExecutorFromContext(ctx context.Context) (Executor, bool) {
	e, ok := ctx.Value(executorKey{}).(Executor)
	return e, ok && e != nil
}

// SQLTxFromContext returns the database/sql transaction ctx carries: in a
// handler behind Middleware built with FromSQLDB, the handler's
// transaction. Write your domain rows in it to commit them with the
// message's completion.
func SQLTxFromContext(ctx context.Context) (*sql.Tx, bool) {
	e, _ := ExecutorFromContext(ctx)
	t, _ := e.(sqlTx)
	tx, ok := t.q.(*sql.Tx)
	return tx, ok
}

// PgxTxFromContext returns the pgx transaction ctx carries: in a handler
// behind Middleware built with FromPgxPool, the handler's transaction.
func PgxTxFromContext(ctx context.Context) (pgx.Tx, bool) {
	e, _ := ExecutorFromContext(ctx)
	t, ok := e.(pgxTx)
	return t.tx, ok
}
