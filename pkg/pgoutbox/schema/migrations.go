package schema

import (
	"bytes"
	"embed"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/template"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
)

// The migration files are templates over the names of one outbox
// (migrationNames): {{.Schema}}, {{.Table}}, {{.DLQ}}, and the functions of
// templateFuncs that derive the other names as Create does ({{idx
// "_suffix"}}, {{qidx "_suffix"}}, {{table "_suffix"}}); {{if .DLQ}} guards
// what concerns the dead-letter table. Adding a version means adding its
// two files and changing Create's DDL (internal/query/ddl.go) to the same
// layout: the tests fail until the migrations, applied from nothing, build
// the catalog Create builds. Conventions, checked by the package's tests:
//   - NNNN_name.up.sql and NNNN_name.down.sql for every version from 1 on,
//     without gaps;
//   - a statement ends with a line that ends with ";", outside a
//     dollar-quoted body (DO $pgoutbox$ ... $pgoutbox$); a line starting
//     with "--" never ends one;
//   - up migrations are idempotent (IF NOT EXISTS, IF EXISTS), so an
//     outbox whose version was recorded conservatively (Baseline) can run
//     the later ones again safely.
//
//go:embed migrations/*.sql
var migrationFiles embed.FS

var dollarTagRE = regexp.MustCompile(`\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$`)

var migrationFileRE = regexp.MustCompile(`^(\d{4})_([a-z0-9_]+)\.(up|down)\.sql$`)

// Migration is one schema version: the statements that reach it from the
// version before (Up) and go back (Down), rendered for one outbox's names.
type Migration struct {
	// Version counts from 1 (the first released layout).
	Version int
	// Name says what the version adds, e.g. "consumer_groups".
	Name string
	// Up and Down are the version's statements, in order, without their
	// final semicolons.
	Up, Down []string
}

type migrationTemplate struct {
	version  int
	name     string
	up, down *template.Template
}

// migrationTemplates parses the embedded files once.
var migrationTemplates = sync.OnceValues(func() ([]migrationTemplate, error) {
	entries, err := fs.ReadDir(migrationFiles, "migrations")
	if err != nil {
		return nil, err
	}
	byVersion := map[int]*migrationTemplate{}
	for _, e := range entries {
		m := migrationFileRE.FindStringSubmatch(e.Name())
		if m == nil {
			return nil, fmt.Errorf("migration file %s: the name is not NNNN_name.up.sql or NNNN_name.down.sql", e.Name())
		}
		v, _ := strconv.Atoi(m[1])
		text, err := migrationFiles.ReadFile(path.Join("migrations", e.Name()))
		if err != nil {
			return nil, err
		}
		t, err := template.New(e.Name()).Option("missingkey=error").Funcs(templateFuncs(query.Names{})).Parse(string(text))
		if err != nil {
			return nil, fmt.Errorf("migration file %s: %w", e.Name(), err)
		}
		mt := byVersion[v]
		if mt == nil {
			mt = &migrationTemplate{version: v, name: m[2]}
			byVersion[v] = mt
		} else if mt.name != m[2] {
			return nil, fmt.Errorf("migration %d is named both %s and %s", v, mt.name, m[2])
		}
		if m[3] == "up" {
			mt.up = t
		} else {
			mt.down = t
		}
	}
	out := make([]migrationTemplate, 0, len(byVersion))
	for v := 1; v <= len(byVersion); v++ {
		mt := byVersion[v]
		if mt == nil {
			return nil, fmt.Errorf("migration %d is missing (versions must count from 1 without gaps)", v)
		}
		if mt.up == nil || mt.down == nil {
			return nil, fmt.Errorf("migration %d (%s) needs both an .up.sql and a .down.sql file", v, mt.name)
		}
		out = append(out, *mt)
	}
	return out, nil
})

// LatestVersion is the version of the layout Create builds: the last
// migration's.
func LatestVersion() int {
	ts, err := migrationTemplates()
	if err != nil {
		panic("pgoutbox: embedded migrations: " + err.Error()) // a build defect, caught by the package's tests
	}
	return len(ts)
}

// migrationNames are the template fields: quoted, schema-qualified.
type migrationNames struct {
	CreateSchema bool   // the schema is not public
	Schema       string // quoted
	Table        string // "schema"."table"
	DLQ          string // "schema"."dlq", "" without a dead-letter table
}

// templateFuncs name objects after the outbox's tables, as Names does
// (query.Derive), so the files and Create's DDL agree on every name:
//
//	{{idx "_ready_idx"}}     "outbox_ready_idx", for CREATE INDEX
//	{{qidx "_ready_idx"}}    "schema"."outbox_ready_idx", for DROP INDEX
//	{{dlqidx "_x_idx"}}      an index named after the dead-letter table
//	{{table "_bindings"}}    "schema"."outbox_bindings"
//	{{arrivalsPkey}}         the arrivals table's primary key, for CONSTRAINT
//	{{createSchema}}         the schema, unless it exists (query.CreateSchema)
func templateFuncs(n query.Names) template.FuncMap {
	q := query.Quote
	return template.FuncMap{
		"arrivalsPkey": func() string { return q(n.WithArrivals().ArrivalsPkey()) },
		"createSchema": func() string { return query.CreateSchema(n) },
		"idx":          func(suffix string) string { return q(query.Derive(n.Table, suffix)) },
		"qidx":         func(suffix string) string { return n.QSchema + "." + q(query.Derive(n.Table, suffix)) },
		"dlqidx":       func(suffix string) string { return q(query.Derive(n.DLQTable, suffix)) },
		"table":        func(suffix string) string { return n.QSchema + "." + q(query.Derive(n.Table, suffix)) },
	}
}

func newMigrationNames(n query.Names) migrationNames {
	return migrationNames{CreateSchema: n.Schema != "public", Schema: n.QSchema, Table: n.QTable, DLQ: n.QDLQ}
}

// MigrationList returns every migration, version 1 first, rendered for
// the names in c. The versions describe a single-table outbox: with
// c.Rotating it returns ErrRotatingMigrations.
func MigrationList(c Config) ([]Migration, error) {
	n, err := c.names()
	if err != nil {
		return nil, err
	}
	if n.Rotating {
		return nil, ErrRotatingMigrations
	}
	return migrationList(n)
}

// ErrArrivalsMigrations is no longer returned: from version 7 the
// versioned migrations create the arrivals table of every single-table
// outbox, so an outbox with Arrivals set migrates like any other.
//
// Deprecated: nothing returns it; it is kept so code that checks for it
// still compiles.
var ErrArrivalsMigrations = errors.New("pgoutbox: the versioned migrations do not create the arrivals table")

// ErrRotatingMigrations is returned by MigrationList, Migrations and
// Migrate for a rotating outbox (Config.Rotating, or an outbox that is
// one): the versioned migrations build and change a single table.
var ErrRotatingMigrations = errors.New("pgoutbox: the versioned migrations describe a single-table outbox, not a rotating one; " +
	"create a rotating outbox with schema.Create or the script of schema.SQL (pgoutbox schema sql --rotating), " +
	"or migrate the single table and then convert it with schema.ConvertToRotating (pgoutbox schema convert-to-rotating)")

func migrationList(n query.Names) ([]Migration, error) {
	ts, err := migrationTemplates()
	if err != nil {
		return nil, fmt.Errorf("pgoutbox: embedded migrations: %w", err)
	}
	data := newMigrationNames(n)
	funcs := templateFuncs(n)
	out := make([]Migration, 0, len(ts))
	for _, t := range ts {
		m := Migration{Version: t.version, Name: t.name}
		if m.Up, err = renderStatements(t.up, funcs, data); err == nil {
			m.Down, err = renderStatements(t.down, funcs, data)
		}
		if err != nil {
			return nil, fmt.Errorf("pgoutbox: render migration %d (%s): %w", t.version, t.name, err)
		}
		out = append(out, m)
	}
	return out, nil
}

func renderStatements(t *template.Template, funcs template.FuncMap, data migrationNames) ([]string, error) {
	// A clone per rendering binds the names: the parsed templates are
	// shared.
	c, err := t.Clone()
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	if err := c.Funcs(funcs).Execute(&b, data); err != nil {
		return nil, err
	}
	return splitStatements(b.String())
}

// splitStatements splits a migration file by the convention above.
func splitStatements(text string) ([]string, error) {
	var out []string
	var cur []string
	hasCode, inBody := false, false
	for line := range strings.Lines(text) {
		line = strings.TrimRight(line, " \t\r\n")
		if len(cur) == 0 && line == "" {
			continue
		}
		cur = append(cur, line)
		isComment := strings.HasPrefix(line, "--")
		if !isComment && strings.TrimSpace(line) != "" {
			hasCode = true
			if len(dollarTagRE.FindAllString(line, -1))%2 == 1 {
				inBody = !inBody
			}
		}
		if !isComment && !inBody && strings.HasSuffix(line, ";") {
			stmt := strings.TrimSuffix(strings.Join(cur, "\n"), ";")
			out = append(out, stmt)
			cur, hasCode = nil, false
		}
	}
	if hasCode {
		return nil, fmt.Errorf("the text after the last statement does not end with a line ending in \";\": %q", strings.Join(cur, "\n"))
	}
	return out, nil
}

// MigrationFormat is a migration tool's file layout.
type MigrationFormat int

const (
	// FormatGoose renders one NNNN_name.sql file per version with
	// "-- +goose Up" and "-- +goose Down" sections, every statement in a
	// StatementBegin/StatementEnd block (so DO blocks stay whole), for
	// goose.NewProvider or the goose command.
	FormatGoose MigrationFormat = iota + 1
	// FormatGolangMigrate renders NNNN_name.up.sql and NNNN_name.down.sql
	// per version, for golang-migrate's iofs source or its -path flag, and
	// for atlas (its golang-migrate directory format).
	FormatGolangMigrate
)

// String returns "goose" or "golang-migrate".
func (f MigrationFormat) String() string {
	switch f {
	case FormatGoose:
		return "goose"
	case FormatGolangMigrate:
		return "golang-migrate"
	}
	return fmt.Sprintf("MigrationFormat(%d)", int(f))
}

// ParseMigrationFormat parses "goose" or "golang-migrate" (also "migrate"
// and "atlas", which reads golang-migrate's layout).
func ParseMigrationFormat(s string) (MigrationFormat, error) {
	switch strings.ToLower(s) {
	case "goose":
		return FormatGoose, nil
	case "golang-migrate", "migrate", "atlas":
		return FormatGolangMigrate, nil
	}
	return 0, fmt.Errorf("pgoutbox: migration format %q is unknown; use goose or golang-migrate (atlas reads golang-migrate's)", s)
}

// Migrations renders the migrations for the names in c as the files of
// one flat directory (the root of the returned fs.FS), in the tool's
// layout:
//
//	fsys, err := schema.Migrations(cfg, schema.FormatGoose)
//	provider, err := goose.NewProvider(goose.DialectPostgres, db, fsys)
//
//	fsys, err := schema.Migrations(cfg, schema.FormatGolangMigrate)
//	src, err := iofs.New(fsys, ".")
//
// The tool keeps its own version table; Migrate keeps pgoutbox's. Use one
// or the other for an outbox, not both. The files build a single-table
// outbox: with c.Rotating, Migrations returns ErrRotatingMigrations.
func Migrations(c Config, f MigrationFormat) (fs.FS, error) {
	ms, err := MigrationList(c)
	if err != nil {
		return nil, err
	}
	files := map[string][]byte{}
	for _, m := range ms {
		base := fmt.Sprintf("%04d_%s", m.Version, m.Name)
		switch f {
		case FormatGoose:
			var b strings.Builder
			b.WriteString("-- +goose Up\n")
			writeGooseStatements(&b, m.Up)
			b.WriteString("\n-- +goose Down\n")
			writeGooseStatements(&b, m.Down)
			files[base+".sql"] = []byte(b.String())
		case FormatGolangMigrate:
			files[base+".up.sql"] = []byte(joinStatements(m.Up))
			files[base+".down.sql"] = []byte(joinStatements(m.Down))
		default:
			return nil, fmt.Errorf("pgoutbox: migration format %v is unknown; use FormatGoose or FormatGolangMigrate", f)
		}
	}
	return memFS(files), nil
}

func writeGooseStatements(b *strings.Builder, stmts []string) {
	for _, s := range stmts {
		b.WriteString("-- +goose StatementBegin\n")
		b.WriteString(s)
		b.WriteString(";\n-- +goose StatementEnd\n")
	}
}

// joinStatements writes statements as one script.
func joinStatements(stmts []string) string {
	return strings.Join(stmts, ";\n\n") + ";\n"
}

// memFS is a flat, read-only directory of files.
type memFS map[string][]byte

var modTime = time.Unix(0, 0)

func (m memFS) Open(name string) (fs.File, error) {
	if !fs.ValidPath(name) {
		return nil, &fs.PathError{Op: "open", Path: name, Err: fs.ErrInvalid}
	}
	if name == "." {
		names := make([]string, 0, len(m))
		for n := range m {
			names = append(names, n)
		}
		slices.Sort(names)
		return &memDir{fs: m, names: names}, nil
	}
	data, ok := m[name]
	if !ok {
		return nil, &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
	}
	return &memFile{info: memInfo{name: name, size: int64(len(data))}, r: bytes.NewReader(data)}, nil
}

// ReadFile and ReadDir spare tools a copy through Open.
func (m memFS) ReadFile(name string) ([]byte, error) {
	if data, ok := m[name]; ok {
		return bytes.Clone(data), nil
	}
	return nil, &fs.PathError{Op: "readfile", Path: name, Err: fs.ErrNotExist}
}

func (m memFS) ReadDir(name string) ([]fs.DirEntry, error) {
	f, err := m.Open(name)
	if err != nil {
		return nil, err
	}
	d, ok := f.(*memDir)
	if !ok {
		return nil, &fs.PathError{Op: "readdir", Path: name, Err: errors.New("not a directory")}
	}
	return d.ReadDir(-1)
}

type memInfo struct {
	name string
	size int64
	dir  bool
}

func (i memInfo) Name() string { return i.name }
func (i memInfo) Size() int64  { return i.size }
func (i memInfo) Mode() fs.FileMode {
	if i.dir {
		return fs.ModeDir | 0o555
	}
	return 0o444
}
func (i memInfo) ModTime() time.Time         { return modTime }
func (i memInfo) IsDir() bool                { return i.dir }
func (i memInfo) Sys() any                   { return nil }
func (i memInfo) Type() fs.FileMode          { return i.Mode().Type() }
func (i memInfo) Info() (fs.FileInfo, error) { return i, nil }

type memFile struct {
	info memInfo
	r    *bytes.Reader
}

func (f *memFile) Stat() (fs.FileInfo, error) { return f.info, nil }
func (f *memFile) Read(p []byte) (int, error) { return f.r.Read(p) }
func (f *memFile) Close() error               { return nil }

type memDir struct {
	fs    memFS
	names []string
	pos   int
}

func (d *memDir) Stat() (fs.FileInfo, error) { return memInfo{name: ".", dir: true}, nil }
func (d *memDir) Read([]byte) (int, error) {
	return 0, &fs.PathError{Op: "read", Path: ".", Err: errors.New("is a directory")}
}
func (d *memDir) Close() error { return nil }
func (d *memDir) ReadDir(n int) ([]fs.DirEntry, error) {
	rest := d.names[d.pos:]
	if n > 0 && len(rest) == 0 {
		return nil, io.EOF
	}
	if n > 0 && n < len(rest) {
		rest = rest[:n]
	}
	d.pos += len(rest)
	out := make([]fs.DirEntry, len(rest))
	for i, name := range rest {
		out[i] = memInfo{name: name, size: int64(len(d.fs[name]))}
	}
	return out, nil
}
