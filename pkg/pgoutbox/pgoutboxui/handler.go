package pgoutboxui

import (
	"context"
	"crypto/rand"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// Defaults of Options.
const (
	DefaultSampleInterval    = 10 * time.Second
	DefaultSamples           = 360
	DefaultMaxPairs          = 500
	DefaultBlockedDeliveries = 3
	DefaultPageTimeout       = 15 * time.Second
	// MinSampleInterval bounds Options.SampleInterval from below.
	MinSampleInterval = 100 * time.Millisecond
)

// Options configure the page. The zero value is a read-only page mounted
// at "/".
type Options struct {
	// BasePath is the path the handler is mounted at, with a leading and
	// a trailing slash ("/outbox/"); links, forms and the CSRF cookie use
	// it. The handler strips it from request paths itself: mount it with
	// mux.Handle(BasePath, ui), without http.StripPrefix. Defaults to "/".
	BasePath string
	// Writes enables the write actions: requeue, delete and purge dead
	// letters, pause and resume a consumer group. Each is a POST with a
	// CSRF token and goes through a confirmation page. Defaults to false:
	// the page only reads, and answers every POST with 403.
	Writes bool
	// SampleInterval is how often the sampler takes one Stats sample of
	// the whole outbox (one statement, a pass over the outbox table: about
	// 0.3 s on 1,000,000 rows), plus the bindings and two rows of table
	// statistics. Defaults to DefaultSampleInterval (10 s); at least
	// MinSampleInterval.
	SampleInterval time.Duration
	// Samples is how many samples the charts keep per topic and group
	// (88 bytes each): the charts span Samples × SampleInterval. Defaults
	// to DefaultSamples (360: an hour at 10 s). Samples × (MaxPairs + 2)
	// samples must fit in 1 GiB.
	Samples int
	// MaxPairs bounds the topic/group pairs that get a chart; the
	// overview lists every pair. Defaults to DefaultMaxPairs (500: at
	// most about 15 MiB of samples with the default Samples).
	MaxPairs int
	// BlockedDeliveries is the delivery count from which the head of an
	// ordering key is shown as blocking its key. Defaults to
	// DefaultBlockedDeliveries (3).
	BlockedDeliveries int
	// Title is shown in the page header and title. Defaults to
	// "pgoutbox".
	Title string
	// PageTimeout bounds what a page, or the confirmation of an action,
	// reads from the database: behind an exclusive lock on the outbox (a
	// VACUUM FULL, an ALTER TABLE, a migration) a page would wait for as
	// long as the lock is held, holding one of the pool's connections,
	// and says so once it gives up. The action itself is not bounded (a
	// purge of many dead letters may take long). Defaults to
	// DefaultPageTimeout (15 s); at least pgoutbox.MinDuration; negative
	// means no bound.
	PageTimeout time.Duration
}

func (o *Options) setDefaults() {
	if o.BasePath == "" {
		o.BasePath = "/"
	}
	if o.SampleInterval == 0 {
		o.SampleInterval = DefaultSampleInterval
	}
	if o.Samples == 0 {
		o.Samples = DefaultSamples
	}
	if o.MaxPairs == 0 {
		o.MaxPairs = DefaultMaxPairs
	}
	if o.BlockedDeliveries == 0 {
		o.BlockedDeliveries = DefaultBlockedDeliveries
	}
	if o.PageTimeout == 0 {
		o.PageTimeout = DefaultPageTimeout
	}
	if o.Title == "" {
		o.Title = "pgoutbox"
	}
}

// maxSampleBytes bounds the memory the charts' samples may take.
const maxSampleBytes = 1 << 30

func (o Options) validate() error {
	var problems []string
	if !strings.HasPrefix(o.BasePath, "/") || !strings.HasSuffix(o.BasePath, "/") || strings.Contains(o.BasePath, "//") {
		problems = append(problems, fmt.Sprintf("BasePath %q must start and end with a slash, e.g. \"/outbox/\"", o.BasePath))
	}
	if o.SampleInterval < MinSampleInterval {
		problems = append(problems, fmt.Sprintf("SampleInterval %s is shorter than %s; sample less often", o.SampleInterval, MinSampleInterval))
	}
	if o.Samples < 2 {
		problems = append(problems, fmt.Sprintf("Samples is %d; a chart needs at least 2", o.Samples))
	}
	if o.MaxPairs < 1 {
		problems = append(problems, fmt.Sprintf("MaxPairs is %d; use 0 for the default (%d) or a positive number", o.MaxPairs, DefaultMaxPairs))
	}
	if o.Samples >= 2 && o.MaxPairs >= 1 {
		// The rings are allocated whole (the page's own two at once): a
		// mistyped Samples must be an error, not an out-of-memory crash.
		if bytes := float64(o.Samples) * float64(o.MaxPairs+2) * float64(unsafe.Sizeof(sample{})); bytes > maxSampleBytes {
			problems = append(problems, fmt.Sprintf("Samples (%d) for up to MaxPairs (%d) pairs would keep up to %.1f GiB of samples (%d bytes each); keep it under 1 GiB with fewer Samples (and a longer SampleInterval) or fewer MaxPairs",
				o.Samples, o.MaxPairs, bytes/(1<<30), unsafe.Sizeof(sample{})))
		}
	}
	if p := errtext.TooShort("PageTimeout", o.PageTimeout); p != "" {
		// Every page would time out before it read anything.
		problems = append(problems, p+", or negative for no bound")
	}
	if o.BlockedDeliveries < 1 {
		problems = append(problems, fmt.Sprintf("BlockedDeliveries is %d; use 0 for the default (%d) or a positive number", o.BlockedDeliveries, DefaultBlockedDeliveries))
	}
	if len(problems) > 0 {
		return fmt.Errorf("%w: pgoutboxui: %s", pgoutbox.ErrInvalidConfig, strings.Join(problems, "; "))
	}
	return nil
}

//go:embed templates/*.html assets/*
var files embed.FS

// UI is the operator page, an http.Handler. Close it when done: it stops
// the sampler.
type UI struct {
	exec   tx.Executor
	tables schema.Config
	names  query.Names
	opts   Options
	secret []byte
	pages  map[string]*template.Template
	assets http.Handler
	samp   *sampler

	startOnce sync.Once
	stop      context.CancelFunc
	done      chan struct{}
	closeOnce sync.Once
}

var _ http.Handler = (*UI)(nil)

// New returns the page for the outbox tables reads and writes through exec
// (tx.FromPgxPool(pool), or a *sql.DB through tx.FromSQLDB). Nothing runs
// until the first request or Start.
func New(exec tx.Executor, tables schema.Config, opts Options) (*UI, error) {
	if exec == nil {
		return nil, fmt.Errorf("%w: pgoutboxui: executor is nil; pass tx.FromPgxPool(pool)", pgoutbox.ErrInvalidConfig)
	}
	opts.setDefaults()
	if err := opts.validate(); err != nil {
		return nil, err
	}
	t := tables.WithDefaults()
	if err := t.Validate(); err != nil {
		return nil, err
	}
	names, err := query.NewNames(t.Schema, t.Table, t.DeadLetterTable)
	if err != nil {
		return nil, fmt.Errorf("%w: pgoutboxui: %v", pgoutbox.ErrInvalidConfig, err)
	}
	ui := &UI{exec: exec, tables: t, names: names, opts: opts, secret: make([]byte, 32), done: make(chan struct{})}
	if _, err := rand.Read(ui.secret); err != nil {
		return nil, fmt.Errorf("pgoutboxui: random secret: %w", err)
	}
	if ui.pages, err = parsePages(opts.BasePath); err != nil {
		return nil, err
	}
	sub, _ := fs.Sub(files, "assets")
	ui.assets = http.StripPrefix(opts.BasePath+"assets/", http.FileServer(http.FS(sub)))
	ui.samp = newSampler(ui, opts.SampleInterval, opts.Samples, opts.MaxPairs)
	return ui, nil
}

// Handler is New for use in an expression; it panics on an invalid
// configuration (a programming error, like template.Must).
func Handler(exec tx.Executor, tables schema.Config, opts Options) *UI {
	ui, err := New(exec, tables, opts)
	if err != nil {
		panic(err)
	}
	return ui
}

// Start starts the sampler, if it is not running yet; the first request
// starts it too. It returns at once.
func (ui *UI) Start() {
	ui.startOnce.Do(func() {
		ctx, cancel := context.WithCancel(context.Background())
		ui.stop = cancel
		go func() {
			defer close(ui.done)
			ui.samp.run(ctx)
		}()
	})
}

// Close stops the sampler and waits for it; pages served afterwards show
// the last sample. Idempotent.
func (ui *UI) Close() error {
	ui.closeOnce.Do(func() {
		ui.startOnce.Do(func() { close(ui.done) }) // never started
		if ui.stop != nil {
			ui.stop()
		}
		<-ui.done
	})
	return nil
}

// Observer returns an Observer to add to the Subscribers (and Publishers)
// of the process serving the page: their acked, dead-lettered and
// published events become the exact rates of the overview and the charts.
// Without it the page estimates rates from the samples and the table
// statistics. It never blocks.
func (ui *UI) Observer() pgoutbox.Observer {
	return pgoutbox.ObserverFunc(ui.samp.observe)
}

// waitFirstSample waits, within ctx, for the sampler's first sample, and
// not at all once the sampler stopped (a UI closed before it sampled
// serves its pages without one).
func (ui *UI) waitFirstSample(ctx context.Context) {
	ui.Start()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	select {
	case <-ui.samp.taken:
	case <-ui.done:
	case <-ctx.Done():
	}
}

// ServeHTTP serves the pages under Options.BasePath.
func (ui *UI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Referrer-Policy", "same-origin")
	if !strings.HasPrefix(r.URL.Path, ui.opts.BasePath) {
		http.NotFound(w, r)
		return
	}
	rest := strings.TrimPrefix(r.URL.Path, ui.opts.BasePath)
	if strings.HasPrefix(rest, "assets/") {
		h.Set("Cache-Control", "max-age=300")
		ui.assets.ServeHTTP(w, r)
		return
	}
	h.Set("Cache-Control", "no-store")
	if ui.opts.PageTimeout > 0 && !(rest == "do" && r.Method == http.MethodPost) {
		ctx, cancel := context.WithTimeout(r.Context(), ui.opts.PageTimeout)
		defer cancel()
		r = r.WithContext(ctx)
	}
	var err error
	switch {
	case rest == "" && isRead(r):
		err = ui.overview(w, r)
	case rest == "group" && isRead(r):
		err = ui.groupPage(w, r)
	case rest == "dead-letters" && isRead(r):
		err = ui.deadLettersPage(w, r)
	case rest == "dead-letter" && isRead(r):
		err = ui.deadLetterPage(w, r)
	case (rest == "confirm" || rest == "do") && r.Method == http.MethodPost:
		err = ui.action(w, r, rest == "do")
	case rest == "" || rest == "group" || rest == "dead-letters" || rest == "dead-letter" || rest == "confirm" || rest == "do":
		h.Set("Allow", "GET, HEAD, POST")
		err = &httpError{code: http.StatusMethodNotAllowed, msg: "method not allowed"}
	default:
		err = &httpError{code: http.StatusNotFound, msg: "no such page"}
	}
	if err != nil {
		ui.fail(w, r, err)
	}
}

func isRead(r *http.Request) bool { return r.Method == http.MethodGet || r.Method == http.MethodHead }

// httpError is an error with a status code and a message for the page.
type httpError struct {
	code int
	msg  string
}

func (e *httpError) Error() string { return e.msg }

func badRequest(format string, args ...any) error {
	return &httpError{code: http.StatusBadRequest, msg: fmt.Sprintf(format, args...)}
}

// fail renders an error page: an httpError's message, or the error of a
// statement (the operator needs it: a missing grant, a missing table).
func (ui *UI) fail(w http.ResponseWriter, r *http.Request, err error) {
	code, msg := http.StatusInternalServerError, err.Error()
	var he *httpError
	if errors.As(err, &he) {
		code = he.code
	}
	if errors.Is(err, pgoutbox.ErrInvalidConfig) || errors.Is(err, pgoutbox.ErrInvalidGroup) || errors.Is(err, pgoutbox.ErrInvalidTopic) {
		code = http.StatusBadRequest
	}
	if errors.Is(err, context.DeadlineExceeded) && errors.Is(r.Context().Err(), context.DeadlineExceeded) {
		code = http.StatusServiceUnavailable
		msg += errtext.NoAnswer(ui.opts.PageTimeout)
	}
	if errtext.SQLState(err) == "42P01" && strings.Contains(msg, "schema apply") {
		// The library's error says how to create the tables already.
	} else if errtext.SQLState(err) == "42P01" && !ui.outboxExists(r.Context()) {
		// A mistyped schema or table: no advice about one table of it.
		msg += fmt.Sprintf("; the outbox %s does not exist: check the schema and table the page was given (pgoutbox ui --schema, --table), "+
			"or create the tables (pgoutbox schema apply)", ui.names.QTable)
	} else if n := ui.names; n.QDLQ != "" && errtext.SQLState(err) == "42P01" && strings.Contains(msg, n.DLQTable) {
		msg += fmt.Sprintf("; the outbox has no dead-letter table %s: if it was made without one, set NoDeadLetterTable in the UI's tables (pgoutbox ui --no-dlq)", n.QDLQ)
	}
	b := ui.page(w, r, "Error", errorData{Code: code, Message: msg})
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(code)
	_ = ui.pages["error"].ExecuteTemplate(w, "layout", b)
}

// base is what every page's layout needs.
type base struct {
	Title    string
	AppTitle string
	Base     string
	Writes   bool
	CSRF     string
	Flash    string
	Nav      string
	Data     any
}

func (ui *UI) page(w http.ResponseWriter, r *http.Request, title string, data any) base {
	return base{Title: title, AppTitle: ui.opts.Title, Base: ui.opts.BasePath, Writes: ui.opts.Writes,
		CSRF: ui.csrfToken(w, r), Flash: ui.flash(r), Data: data}
}

func (ui *UI) render(w http.ResponseWriter, r *http.Request, name, title string, data any) error {
	b := ui.page(w, r, title, data)
	b.Nav = name
	var buf strings.Builder
	if err := ui.pages[name].ExecuteTemplate(&buf, "layout", b); err != nil {
		return fmt.Errorf("pgoutboxui: render %s: %w", name, err)
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	_, err := w.Write([]byte(buf.String()))
	return err
}

type errorData struct {
	Code    int
	Message string
}

// outboxExists reports whether the outbox table exists (true when that
// cannot be read: the advice then stays as it was).
func (ui *UI) outboxExists(ctx context.Context) bool {
	rows, err := ui.exec.Query(ctx, "SELECT to_regclass($1) IS NOT NULL", ui.names.QTable)
	if err != nil {
		return true
	}
	defer rows.Close()
	exists := true
	if rows.Next() && rows.Scan(&exists) != nil {
		return true
	}
	return exists
}
