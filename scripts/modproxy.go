//go:build ignore

// modproxy serves the working tree as one version of the main module: it
// writes a file-based GOPROXY (the layout of https://go.dev/ref/mod#goproxy-protocol)
// holding the tree's files as that version's zip, and prints the two go.sum
// lines of that version. scripts/check-modules.sh uses it to build each
// submodule without the workspace, as users will once the version is tagged.
//
//	go run scripts/modproxy.go <proxy dir> <version>
package main

import (
	"archive/zip"
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strings"
)

func main() {
	if len(os.Args) != 3 {
		fail("usage: go run scripts/modproxy.go <proxy dir> <version>")
	}
	proxy, version := os.Args[1], os.Args[2]
	gomod, err := os.ReadFile("go.mod")
	if err != nil {
		fail("run from the main module's root: %v", err)
	}
	modPath := modulePath(gomod)
	files := moduleFiles()

	dir := filepath.Join(proxy, filepath.FromSlash(modPath), "@v")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		fail("%v", err)
	}
	prefix := modPath + "@" + version + "/"
	var buf bytes.Buffer
	zw := zip.NewWriter(&buf)
	sums := map[string][]byte{}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			fail("%v", err)
		}
		w, err := zw.Create(prefix + f)
		if err != nil {
			fail("%v", err)
		}
		if _, err := w.Write(data); err != nil {
			fail("%v", err)
		}
		sum := sha256.Sum256(data)
		sums[prefix+f] = sum[:]
	}
	if err := zw.Close(); err != nil {
		fail("%v", err)
	}
	write := func(name string, data []byte) {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			fail("%v", err)
		}
	}
	write(version+".zip", buf.Bytes())
	write(version+".mod", gomod)
	write(version+".info", []byte(fmt.Sprintf(`{"Version":%q,"Time":"2026-01-01T00:00:00Z"}`+"\n", version)))
	write("list", []byte(version+"\n"))

	modSum := sha256.Sum256(gomod)
	fmt.Printf("%s %s %s\n", modPath, version, hash1(sums))
	fmt.Printf("%s %s/go.mod %s\n", modPath, version, hash1(map[string][]byte{"go.mod": modSum[:]}))
}

// hash1 is the go.sum "h1:" hash (golang.org/x/mod/sumdb/dirhash.Hash1):
// the SHA-256 of the sorted lines "<sha256 hex>  <name>".
func hash1(sums map[string][]byte) string {
	names := make([]string, 0, len(sums))
	for n := range sums {
		names = append(names, n)
	}
	sort.Strings(names)
	h := sha256.New()
	for _, n := range names {
		fmt.Fprintf(h, "%x  %s\n", sums[n], n)
	}
	return "h1:" + base64.StdEncoding.EncodeToString(h.Sum(nil))
}

func modulePath(gomod []byte) string {
	sc := bufio.NewScanner(bytes.NewReader(gomod))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 2 && f[0] == "module" {
			return strings.Trim(f[1], `"`)
		}
	}
	fail("go.mod has no module line")
	return ""
}

// moduleFiles lists the files of the main module as git sees the working
// tree (tracked and untracked, not ignored), without the directories of
// other modules, which a module zip must not hold.
func moduleFiles() []string {
	out, err := exec.Command("git", "ls-files", "--cached", "--others", "--exclude-standard").Output()
	if err != nil {
		fail("git ls-files: %v", err)
	}
	// A file in conflict is listed once per stage.
	var all []string
	seen := map[string]bool{}
	for _, f := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if !seen[f] {
			seen[f] = true
			all = append(all, f)
		}
	}
	var nested []string
	for _, f := range all {
		if path.Base(f) == "go.mod" && f != "go.mod" {
			nested = append(nested, path.Dir(f)+"/")
		}
	}
	var files []string
outer:
	for _, f := range all {
		if f == "go.work" || f == "go.work.sum" {
			continue
		}
		for _, n := range nested {
			if strings.HasPrefix(f, n) {
				continue outer
			}
		}
		if st, err := os.Lstat(f); err != nil || !st.Mode().IsRegular() {
			continue // deleted in the working tree, or a symlink
		}
		files = append(files, f)
	}
	return files
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "modproxy: "+format+"\n", args...)
	os.Exit(1)
}
