package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/km0/km0/internal/cli"
	"github.com/km0/km0/internal/services/system"
)

// No container engine runs on this machine, so the deploy artefacts are
// checked here against the binary itself: every command line of the
// Kubernetes manifests and of the compose file parses with km0's real flags,
// every probe targets a path the server on that port serves, every
// environment variable named is one km0 reads, credentials come from
// Secrets, and the image is static, non-root and without a shell.

// km0Env is every environment variable km0 reads: the KM0_* names spelled
// in its non-test Go code (os.Getenv arguments and the constants passed to
// it), plus the per-service KM0_<SERVICE>_DATABASE_URL built at run time.
func km0Env(t *testing.T) map[string]bool {
	t.Helper()
	re := regexp.MustCompile(`"(KM0_[A-Z0-9_]+)"`)
	env := map[string]bool{}
	err := filepath.WalkDir("../..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "third_party" || d.Name() == ".git" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range re.FindAllStringSubmatch(string(b), -1) {
			env[m[1]] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range system.Services {
		env[serviceDatabaseEnv(s)] = true
	}
	if !env["KM0_KAFKA_BROKERS"] || !env["KM0_DATABASE_URL"] {
		t.Fatalf("the scan of the code found no KM0_KAFKA_BROKERS or KM0_DATABASE_URL: %v", env)
	}
	return env
}

// checkArgs runs km0's command args up to the end of its flag parsing
// (cli.ParseOnly) and fails unless every flag parsed.
func checkArgs(t *testing.T, where string, args []string) {
	t.Helper()
	if len(args) == 0 {
		t.Errorf("%s: no command line", where)
		return
	}
	c, ok := commands[args[0]]
	if !ok {
		t.Errorf("%s: km0 has no command %q", where, args[0])
		return
	}
	if err := c.run(context.Background(), args[1:]); !errors.Is(err, cli.ErrParsed) {
		t.Errorf("%s: km0 %s does not parse: %v", where, strings.Join(args, " "), err)
	}
}

// served is the path and port of every HTTP endpoint a command line
// serves: `serve NAME --http NAME=:PORT` serves system.HealthPath there;
// `relay --metrics-addr :PORT` serves relayHealthPath and /metrics.
func served(args []string) map[string]int {
	out := map[string]int{}
	port := func(addr string) int {
		_, p, _ := strings.Cut(addr, ":")
		n, _ := strconv.Atoi(p)
		return n
	}
	switch {
	case len(args) > 1 && args[0] == "serve":
		for i, a := range args {
			if a == "--http" && i+1 < len(args) {
				for _, kv := range strings.Split(args[i+1], ",") {
					if k, v, _ := strings.Cut(kv, "="); k == args[1] {
						out[system.HealthPath] = port(v)
					}
				}
			}
		}
	case len(args) > 0 && args[0] == "relay":
		for i, a := range args {
			if a == "--metrics-addr" && i+1 < len(args) {
				out[relayHealthPath], out["/metrics"] = port(args[i+1]), port(args[i+1])
			}
		}
	}
	return out
}

// credential reports whether an environment variable carries a secret.
func credential(name string) bool {
	for _, w := range []string{"DATABASE_URL", "TOKEN", "PASSWORD", "SECRET", "AMQP_URL", "PASSARELLA_URL", "SASL"} {
		if strings.Contains(name, w) {
			return true
		}
	}
	return false
}

// credentialFlag matches a credential given on the command line (ps shows
// it) rather than in the environment or a file.
var credentialFlag = regexp.MustCompile(`^--?(database-url|service-database-url|amqp-url|gateway-url|admin-token|sasl-[a-z-]*password|password)(=|$)`)

type k8sObject struct {
	Kind     string `yaml:"kind"`
	Metadata struct {
		Name   string            `yaml:"name"`
		Labels map[string]string `yaml:"labels"`
	} `yaml:"metadata"`
	Data       map[string]string `yaml:"data"`
	StringData map[string]string `yaml:"stringData"`
	Resources  []string          `yaml:"resources"`
	Spec       struct {
		Replicas     *int       `yaml:"replicas"`
		MinAvailable *int       `yaml:"minAvailable"`
		Selector     k8sLabels  `yaml:"selector"`
		Template     k8sPodTmpl `yaml:"template"`
	} `yaml:"spec"`
}

type k8sLabels struct {
	MatchLabels map[string]string `yaml:"matchLabels"`
}

type k8sPodTmpl struct {
	Metadata struct {
		Labels map[string]string `yaml:"labels"`
	} `yaml:"metadata"`
	Spec struct {
		SecurityContext struct {
			RunAsNonRoot *bool `yaml:"runAsNonRoot"`
			RunAsUser    *int  `yaml:"runAsUser"`
		} `yaml:"securityContext"`
		Containers []k8sContainer `yaml:"containers"`
	} `yaml:"spec"`
}

type k8sProbe struct {
	HTTPGet *struct {
		Path string `yaml:"path"`
		Port int    `yaml:"port"`
	} `yaml:"httpGet"`
}

type k8sContainer struct {
	Name    string   `yaml:"name"`
	Command []string `yaml:"command"`
	Args    []string `yaml:"args"`
	EnvFrom []any    `yaml:"envFrom"`
	Env     []struct {
		Name      string `yaml:"name"`
		Value     string `yaml:"value"`
		ValueFrom *struct {
			SecretKeyRef    *struct{ Name, Key string } `yaml:"secretKeyRef"`
			ConfigMapKeyRef *struct{ Name, Key string } `yaml:"configMapKeyRef"`
		} `yaml:"valueFrom"`
	} `yaml:"env"`
	ReadinessProbe *k8sProbe `yaml:"readinessProbe"`
	LivenessProbe  *k8sProbe `yaml:"livenessProbe"`
	Resources      struct {
		Requests map[string]string `yaml:"requests"`
		Limits   map[string]string `yaml:"limits"`
	} `yaml:"resources"`
	SecurityContext struct {
		AllowPrivilegeEscalation *bool `yaml:"allowPrivilegeEscalation"`
		ReadOnlyRootFilesystem   *bool `yaml:"readOnlyRootFilesystem"`
	} `yaml:"securityContext"`
}

func readObjects(t *testing.T, path string) []k8sObject {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []k8sObject
	dec := yaml.NewDecoder(f)
	for {
		var o k8sObject
		err := dec.Decode(&o)
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		out = append(out, o)
	}
}

// Not parallel: it sets cli.ParseOnly, a package variable every command's
// flag parsing reads.
func TestKubernetesManifestsMatchTheBinary(t *testing.T) {
	cli.ParseOnly = true
	defer func() { cli.ParseOnly = false }()
	env := km0Env(t)
	dir := "../../deploy/kubernetes"
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests in %s: %v", dir, err)
	}
	var kustomization k8sObject
	secrets, configMaps := map[string]bool{}, map[string]bool{} // "name/key"
	var deployments, pdbs []k8sObject
	where := map[string]string{}
	for _, f := range files {
		for _, o := range readObjects(t, f) {
			switch o.Kind {
			case "Kustomization":
				kustomization = o
			case "Secret":
				for k := range o.StringData {
					secrets[o.Metadata.Name+"/"+k] = true
				}
			case "ConfigMap":
				for k := range o.Data {
					configMaps[o.Metadata.Name+"/"+k] = true
				}
			case "Deployment":
				deployments = append(deployments, o)
				where[o.Metadata.Name] = filepath.Base(f)
			case "PodDisruptionBudget":
				pdbs = append(pdbs, o)
			}
		}
	}
	var servicesSeen []string
	for _, d := range deployments {
		name := where[d.Metadata.Name] + ": Deployment " + d.Metadata.Name
		if !slices.Contains(kustomization.Resources, where[d.Metadata.Name]) {
			t.Errorf("%s: its file is not in kustomization.yaml", name)
		}
		pod := d.Spec.Template
		for k, v := range d.Spec.Selector.MatchLabels {
			if pod.Metadata.Labels[k] != v {
				t.Errorf("%s: the selector %s=%s does not match the pod's labels", name, k, v)
			}
		}
		if sc := pod.Spec.SecurityContext; sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser == 0 {
			t.Errorf("%s: the pod must run as non-root (runAsNonRoot, a runAsUser other than 0)", name)
		}
		protected := false
		for _, p := range pdbs {
			match := len(p.Spec.Selector.MatchLabels) > 0
			for k, v := range p.Spec.Selector.MatchLabels {
				match = match && pod.Metadata.Labels[k] == v
			}
			if match && p.Spec.MinAvailable != nil && d.Spec.Replicas != nil && *p.Spec.MinAvailable < *d.Spec.Replicas {
				protected = true
			}
		}
		if !protected {
			t.Errorf("%s: no PodDisruptionBudget selects its pods with minAvailable below its replicas", name)
		}
		if len(pod.Spec.Containers) != 1 {
			t.Fatalf("%s: %d containers, want the one km0 container", name, len(pod.Spec.Containers))
		}
		c := pod.Spec.Containers[0]
		if len(c.Command) > 0 {
			t.Errorf("%s: command %v replaces the image's entrypoint /km0; give args only", name, c.Command)
		}
		checkArgs(t, name, c.Args)
		for _, a := range c.Args {
			if credentialFlag.MatchString(a) {
				t.Errorf("%s: %s on the command line shows in ps; take it from a Secret through the environment", name, a)
			}
		}
		if len(c.Args) > 1 && c.Args[0] == "serve" {
			servicesSeen = append(servicesSeen, c.Args[1])
		}
		paths := served(c.Args)
		for kind, p := range map[string]*k8sProbe{"readinessProbe": c.ReadinessProbe, "livenessProbe": c.LivenessProbe} {
			switch {
			case p == nil || p.HTTPGet == nil:
				t.Errorf("%s: no HTTP %s", name, kind)
			case paths[p.HTTPGet.Path] == 0:
				t.Errorf("%s: %s path %s is served by no server of km0 %s (served: %v)", name, kind, p.HTTPGet.Path, strings.Join(c.Args, " "), paths)
			case paths[p.HTTPGet.Path] != p.HTTPGet.Port:
				t.Errorf("%s: %s probes port %d, but %s is served on %d", name, kind, p.HTTPGet.Port, p.HTTPGet.Path, paths[p.HTTPGet.Path])
			}
		}
		if c.Resources.Requests["cpu"] == "" || c.Resources.Requests["memory"] == "" || c.Resources.Limits["memory"] == "" {
			t.Errorf("%s: resources want cpu and memory requests and a memory limit, got %+v", name, c.Resources)
		}
		if sc := c.SecurityContext; sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
			t.Errorf("%s: want allowPrivilegeEscalation false and readOnlyRootFilesystem true", name)
		}
		if len(c.EnvFrom) > 0 {
			t.Errorf("%s: envFrom hides which variables it sets; name each one", name)
		}
		for _, e := range c.Env {
			if !env[e.Name] {
				t.Errorf("%s: km0 reads no environment variable %s", name, e.Name)
			}
			switch {
			case e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil:
				if ref := e.ValueFrom.SecretKeyRef; !secrets[ref.Name+"/"+ref.Key] {
					t.Errorf("%s: %s takes key %s of Secret %s, which secrets.example.yaml does not show", name, e.Name, ref.Key, ref.Name)
				}
			case credential(e.Name):
				t.Errorf("%s: %s is a credential: take it from a Secret (valueFrom.secretKeyRef)", name, e.Name)
			case e.ValueFrom != nil && e.ValueFrom.ConfigMapKeyRef != nil:
				if ref := e.ValueFrom.ConfigMapKeyRef; !configMaps[ref.Name+"/"+ref.Key] {
					t.Errorf("%s: %s takes key %s of ConfigMap %s, which no manifest defines", name, e.Name, ref.Key, ref.Name)
				}
			}
		}
	}
	slices.Sort(servicesSeen)
	want := slices.Sorted(slices.Values(system.Services))
	if !slices.Equal(servicesSeen, want) {
		t.Errorf("Deployments of km0 serve for %v, want one for each of %v", servicesSeen, want)
	}
	if !slices.ContainsFunc(deployments, func(d k8sObject) bool {
		cs := d.Spec.Template.Spec.Containers
		return len(cs) == 1 && len(cs[0].Args) > 0 && cs[0].Args[0] == "relay"
	}) {
		t.Error("no Deployment of km0 relay")
	}
}

// Not parallel: it sets cli.ParseOnly, a package variable every command's
// flag parsing reads.
func TestComposeFileMatchesTheBinary(t *testing.T) {
	cli.ParseOnly = true
	defer func() { cli.ParseOnly = false }()
	env := km0Env(t)
	b, err := os.ReadFile("../../deploy/kafka/compose.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var compose struct {
		Services map[string]struct {
			Image       string            `yaml:"image"`
			Command     []string          `yaml:"command"`
			Ports       []string          `yaml:"ports"`
			Environment map[string]string `yaml:"environment"`
		} `yaml:"services"`
	}
	if err := yaml.Unmarshal(b, &compose); err != nil {
		t.Fatal(err)
	}
	var seen []string
	for name, s := range compose.Services {
		if s.Image != "km0:local" {
			continue
		}
		where := "compose service " + name
		checkArgs(t, where, s.Command)
		if len(s.Command) > 1 && s.Command[0] == "serve" {
			seen = append(seen, s.Command[1])
		}
		for k := range s.Environment {
			if !env[k] {
				t.Errorf("%s: km0 reads no environment variable %s", where, k)
			}
		}
		port := served(s.Command)[system.HealthPath]
		if port == 0 || !slices.Contains(s.Ports, fmt.Sprintf("%d:%d", port, port)) {
			t.Errorf("%s: ports %v do not publish the port %d that serves %s", where, s.Ports, port, system.HealthPath)
		}
	}
	slices.Sort(seen)
	if want := slices.Sorted(slices.Values(system.Services)); !slices.Equal(seen, want) {
		t.Errorf("compose runs km0 serve for %v, want each of %v", seen, want)
	}
	for _, dep := range []string{"kafka", "postgres"} {
		if _, ok := compose.Services[dep]; !ok {
			t.Errorf("compose has no %s service", dep)
		}
	}
}

// The image: built static (CGO_ENABLED=0) in one stage, run from a final
// stage with no shell (distroless static or scratch) as a non-root user,
// with /km0 as the entrypoint, on the Go of go.mod.
func TestDockerfileBuildsAStaticNonRootImageWithoutAShell(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("../../deploy/Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	var froms []string
	var user, entry string
	var build string
	for _, line := range strings.Split(strings.ReplaceAll(string(b), "\\\n", " "), "\n") {
		line = strings.TrimSpace(line)
		switch f := strings.Fields(line); {
		case len(f) == 0 || strings.HasPrefix(line, "#"):
		case f[0] == "FROM":
			froms, user, entry = append(froms, f[1]), "", ""
		case f[0] == "USER":
			user = f[1]
		case f[0] == "ENTRYPOINT":
			entry = strings.TrimSpace(strings.TrimPrefix(line, "ENTRYPOINT"))
		case f[0] == "RUN" && strings.Contains(line, "go build"):
			build = line
		}
	}
	if len(froms) < 2 {
		t.Fatalf("FROM %v: want a build stage and a runtime stage", froms)
	}
	final := froms[len(froms)-1]
	if final != "scratch" && !strings.HasPrefix(final, "gcr.io/distroless/static") {
		t.Errorf("final stage FROM %s: want scratch or distroless static (no shell)", final)
	}
	if uid, _, _ := strings.Cut(user, ":"); user == "" || uid == "0" || uid == "root" {
		t.Errorf("final stage USER %q: want a non-root user", user)
	}
	if entry != `["/km0"]` {
		t.Errorf("ENTRYPOINT %s, want [\"/km0\"] (exec form: there is no shell)", entry)
	}
	for _, want := range []string{"CGO_ENABLED=0", "./cmd/km0", "github.com/km0/km0/internal/buildinfo.version=", "github.com/km0/km0/internal/buildinfo.commit="} {
		if !strings.Contains(build, want) {
			t.Errorf("the go build step lacks %s: %s", want, build)
		}
	}
	mod, err := os.ReadFile("../../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	goVersion := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(mod)
	if goVersion == nil || froms[0] != "golang:"+string(goVersion[1]) && !strings.HasPrefix(froms[0], "golang:"+string(goVersion[1])+".") {
		t.Errorf("build stage FROM %s, want golang:%s (go.mod)", froms[0], goVersion[1])
	}
}
